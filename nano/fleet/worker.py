"""A tensor-parallel rank > 0: it loads its shard (nano/shard.py) and replays the steps rank 0
broadcasts (engine.LLMEngine schedules and samples for every rank). The core loads the shard
and replays a step; the loop is its launcher's, run.py's or a fleet rank's."""
from nano import parallel
from nano.config import EngineConfig
from nano.plan import packed_shape, unpack_step
from nano.shard import load_shard


class Worker:
    def __init__(self, config: EngineConfig):
        self.group = parallel.tp_group()
        self.runner = load_shard(config, self.group).runner

    def run(self) -> None:
        """Replay each step rank 0 broadcasts on this rank's shard, until it says stop. What a
        SIGINT does here is its driver's (the command line passes it on to rank 0:
        cli/offline.forward_interrupts)."""
        while (packed := self.group.broadcast(None)) is not None:
            swaps = unpack_step(packed, packed_shape(packed))
            self.runner.swap(swaps["blocks_to_swap_out"], swaps["blocks_to_swap_in"])
            inputs = self.runner.to_device(packed)
            if inputs is not None:
                self.runner.forward(inputs)  # its share of the all-reduces; rank 0 alone samples
