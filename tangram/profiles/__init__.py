"""Real-model calibration: offline corpus, scoring methods, retention samples -> BudgetProfile, fidelity report.

``tangram.profiles.default_profile_path(model, method, scope, rho)`` names the shipped profile of a run
(:mod:`tangram.profiles.registry`, torch-free)."""


def __getattr__(name):  # lazy, so ``python -m tangram.profiles.registry`` runs the module once
    if name in ("default_profile_path", "shipped_profiles"):
        from tangram.profiles import registry
        return getattr(registry, name)
    raise AttributeError(f"module 'tangram.profiles' has no attribute {name!r}")
