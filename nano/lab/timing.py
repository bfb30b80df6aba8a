"""Engines for the experiments whose figures are times (deadlines, autoscaling): at quick
size on the simulated clock (nano/bench/simulated.py: the real forward pass, each step
charged a fixed step-time model), so the comparison is exact and the same on any machine;
at full size on the real clock, warmed up."""
from nano.bench import simulated
from nano.config import EngineConfig
from nano.lab.experiment import Size, engine, model_of
from nano.policy import FCFS


def clocked_engine(size: Size, policy=FCFS, **config_overrides):
    if size.quick:
        return simulated.simulated_engine(EngineConfig(model=model_of(size), device=size.device, seed=size.seed,
                                                       **config_overrides), policy=policy)
    return engine(size, policy, **config_overrides)
