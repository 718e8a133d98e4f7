"""Alembic migrations of the cachesvc catalog (shipped as a package so installs can migrate)."""
