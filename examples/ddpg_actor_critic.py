"""DDPG's two updates, with the gradient stopped where it must be.

* Critic update: the critic learns from ``Q(s, actor(s))``; the actor must be untouched and
  should compute nothing. ``gg.stop_gradient_at(ac, "critic")`` cuts at the critic's input,
  so the actor runs without autograd: no graph, no saved activations, no gradients.
* Actor update: ``-Q(s, actor(s))`` is backpropagated *through* the critic into the actor,
  and the critic must not learn from it. ``gg.frozen(ac, "critic")`` stops the critic's
  wgrad while its dgrad still reaches the actor.

Evidence: parameter ``.grad`` stays ``None`` where nothing may learn, weights stay
bit-identical, ``gg.audit`` counts wgrad = dgrad = 0 for the actor in the critic update, and
``FlopCounterMode`` shows the critic update's backward costs exactly what
the hand-written ideal (``actor(s).detach()``) costs.
"""

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import gradgate as gg


class Critic(nn.Module):
    def __init__(self, state: int, action: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(state + action, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, state: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([state, action], dim=-1))


class ActorCritic(nn.Module):
    """Q(s, actor(s)): the actor's action feeds the critic."""

    def __init__(self, state: int = 8, action: int = 2) -> None:
        super().__init__()
        self.actor = nn.Sequential(
            nn.Linear(state, 64), nn.ReLU(), nn.Linear(64, action), nn.Tanh()
        )
        self.critic = Critic(state, action)

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        return self.critic(state, self.actor(state))


def backward_flops(loss: torch.Tensor) -> int:
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    return counter.get_total_flops()


def main() -> None:
    torch.manual_seed(0)
    ac = ActorCritic()
    actor_opt = torch.optim.Adam(ac.actor.parameters(), lr=1e-3)
    critic_opt = torch.optim.Adam(ac.critic.parameters(), lr=1e-3)
    state, target_q = torch.randn(32, 8), torch.randn(32, 1)

    # -- critic update: the actor computes nothing -----------------------------------------
    actor_before = [p.detach().clone() for p in ac.actor.parameters()]
    critic_opt.zero_grad(set_to_none=True)
    with gg.stop_gradient_at(ac, "critic"):
        q = ac(state)
    critic_flops = backward_flops(nn.functional.mse_loss(q, target_q))
    actor_grads_none = all(p.grad is None for p in ac.actor.parameters())
    critic_opt.step()
    actor_same = all(
        torch.equal(a, b) for a, b in zip(actor_before, ac.actor.parameters(), strict=True)
    )

    ideal_q = ac.critic(state, ac.actor(state).detach())
    ideal_flops = backward_flops(nn.functional.mse_loss(ideal_q, target_q))
    ac.zero_grad(set_to_none=True)
    naive_flops = backward_flops(nn.functional.mse_loss(ac(state), target_q))
    ac.zero_grad(set_to_none=True)

    # audit evidence: in the critic update the actor computes no wgrad and no dgrad
    with gg.audit(ac) as report:
        with gg.stop_gradient_at(ac, "critic"):
            q = ac(state)
        nn.functional.mse_loss(q, target_q).backward()
    audited_actor = report.module("actor")
    ac.zero_grad(set_to_none=True)

    # -- actor update: through the critic, which does not learn ----------------------------
    critic_before = [p.detach().clone() for p in ac.critic.parameters()]
    actor_opt.zero_grad(set_to_none=True)
    with gg.frozen(ac, "critic"):
        (-ac(state).mean()).backward()
        critic_grads_none = all(p.grad is None for p in ac.critic.parameters())
        actor_learns = all(p.grad is not None for p in ac.actor.parameters())
        actor_opt.step()

    print(f"critic update: actor .grad all None: {actor_grads_none}")
    print(f"critic update: actor weights bit-identical: {actor_same}")
    print(f"critic update audit: actor wgrad={audited_actor.wgrad} dgrad={audited_actor.dgrad}")
    print(
        f"critic update backward FLOPs: gradgate {critic_flops}, ideal {ideal_flops}, "
        f"naive {naive_flops}"
    )
    print(f"critic update costs exactly the ideal: {critic_flops == ideal_flops < naive_flops}")
    print(f"actor update: critic .grad all None: {critic_grads_none}")
    print(f"actor update: actor gets gradients through the critic: {actor_learns}")
    critic_same = all(
        torch.equal(a, b) for a, b in zip(critic_before, ac.critic.parameters(), strict=True)
    )
    print(f"actor update: critic weights bit-identical: {critic_same}")


if __name__ == "__main__":
    main()
