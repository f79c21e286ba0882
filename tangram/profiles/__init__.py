"""Real-model calibration: offline corpus, scoring methods, retention samples -> BudgetProfile, fidelity report."""
