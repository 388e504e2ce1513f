"""_plumbing"""
