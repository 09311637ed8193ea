"""Where checkpoints live: one layout (``layout``) in a local directory (``local``) or under an S3 prefix (``s3``,
the one module that imports boto3), chosen by URL (``store.open_store``). The trainer hooks write through it, the
controller and the CLI read through it. Imports ``opsd.protocol`` (the manifest) and below."""
