"""The pretraining job program on megatron-core (module `pretrain`; the loop is in `trainer`)."""
