"""Workflows: models of workflow and site files, validation, the scheduler, the run DB."""
