"""Other frameworks' configurations in klgrpo's terms: the table shape and the one call of the objective with a
mapped config (``mapping``), TRL's fields (``trl_mapping``), verl's (``verl_mapping``) and OpenRLHF's
(``openrlhf_mapping``). The public integrations stay at the top of the package: ``klgrpo.trl`` (klgrpo's objective
inside TRL's GRPOTrainer) and ``klgrpo.custom`` (datum-shaped custom losses)."""
