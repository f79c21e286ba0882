"""Real-model calibration: offline corpus, scoring methods, retention samples -> BudgetProfile, fidelity report.

``default_profile_path(model, method, scope, rho)`` names the shipped profile of a run (torch-free import)."""
from tangram.profiles.registry import default_profile_path, shipped_profiles  # noqa: F401
