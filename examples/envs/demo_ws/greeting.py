"""A module of the demo environment's workspace: the workers import it from their tree."""

VALUE = 1
