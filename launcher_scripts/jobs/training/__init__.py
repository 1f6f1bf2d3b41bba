"""The pretraining job program, built on megatron-core (`python -m launcher_scripts.jobs.training.pretrain`)."""
