"""Scripts of the repository (install steps, reproducers, the soak, pictures): not part of the installed package."""
