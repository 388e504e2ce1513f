"""The suite's warning policy (pyproject's filterwarnings): a deprecation fails a test when our
code triggers it, and not when a third-party package's own code raises it."""

from __future__ import annotations

import warnings

import pytest


def _warn_from(module_name: str, category: type[Warning]) -> None:
    """``warnings.warn`` called from a function whose module is ``module_name``."""
    namespace = {"__name__": module_name, "warnings": warnings, "category": category}
    exec("def call():\n    warnings.warn('old API', category, stacklevel=1)", namespace)
    namespace["call"]()  # type: ignore[operator]


CATEGORIES = [DeprecationWarning, PendingDeprecationWarning, FutureWarning]


@pytest.mark.parametrize("category", CATEGORIES)
@pytest.mark.parametrize("module", ["transformers.masking_utils", "lightning.fabric", "torch.nn"])
def test_a_third_party_deprecation_raised_by_its_own_code_passes(module, category):
    _warn_from(module, category)


@pytest.mark.parametrize("category", CATEGORIES)
@pytest.mark.parametrize(
    "module", ["gradgate._bench.hf", "test_bench", "models.zoo", "docs.index", "__main__"]
)
def test_a_deprecation_our_code_triggers_fails(module, category):
    with pytest.raises(category, match="old API"):
        _warn_from(module, category)


def test_other_third_party_warnings_still_fail():
    with pytest.raises(UserWarning, match="old API"):
        _warn_from("transformers.modeling_utils", UserWarning)
