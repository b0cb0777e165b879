"""The run folder and what is written into it: the lock and layout (:mod:`.folder`),
checkpoints (:mod:`.checkpoint`), the HF export (:mod:`.export`), composed by
:class:`~verl_ppo.run.run_dir.RunFolder`."""
