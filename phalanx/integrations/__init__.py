"""Entry points into phalanx from other tools (Airflow, Jupyter); each is an optional extra."""
