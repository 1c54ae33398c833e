"""Proposers: who drafts the tokens the target verifies.

``registry`` names every proposer (torch-free: settings and the HTTP layer read it); ``base`` holds
the protocol. This package imports nothing itself, so that the registry loads without torch.
"""
