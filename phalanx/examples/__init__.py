"""Stage apps of the example workflows in workflows/.

- ``phalanx.examples.synthetic``: workflows/etl_to_training.yaml — synthetic transactions and
  users → per-user features with DataFrame operators → a DDP-trained MLP.
- ``phalanx.examples.tpch``: workflows/tpch.yaml — TPC-H-like tables generated in the workflow,
  then Q1 (pricing summary) and Q3 (shipping priority) as distributed joins and aggregates.

Each app takes ``env`` (a ``BSPEnv``) and runs on every rank of its stage's gang.
"""
