"""opsd inside the trainers people run (docs/integrations.md): each module adapts one framework through its own
extension points, and imports that framework, which its extra installs (``opsd[hf]``)."""
