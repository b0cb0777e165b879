"""The job: a config resolved once. The cross-key rules (:mod:`.rules`), every ``auto``
decided into a frozen :class:`~verl_ppo.job.fast_path.ResolvedJob` (:mod:`.fast_path`), the
checks run before any rank starts (:mod:`.preflight`, :mod:`.resume_check`) and the model
facts they read (:mod:`.model_family`, :mod:`.model_dims`).

Empty on purpose: importing the schema (:mod:`verl_ppo.config`) imports
:mod:`.strict_model` from here and nothing else.
"""
