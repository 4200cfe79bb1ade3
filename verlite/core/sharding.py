"""Whether FSDP2 shards a model: the one rule that ``distributed.apply_fsdp`` applies and the
config's decisions that depend on it read (``Config.generation_copied``)."""


def fsdp_shards(world: int, *, offload: bool) -> bool:
    """Whether ``distributed.apply_fsdp`` shards a model with FSDP2 over ``world`` ranks: over
    more than one, or with its CPU offload (``offload``), which shards at world 1 too, over a
    group of one rank; one rank's model without offload stays whole."""
    return world > 1 or offload
