"""One experiment per module, each defining a module-level `EXPERIMENT` (nano.lab.experiment.
Experiment); nano.lab.driver finds them with pkgutil, so a new one needs no list edited."""
