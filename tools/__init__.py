"""Development tooling of the retrospec repository (not part of the library; run from the repository root)."""
