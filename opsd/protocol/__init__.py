"""What crosses a process boundary: the rank's step report (``wire``), the agent's heartbeat (``heartbeat``), the
policy file (``policy_file``), the checkpoint manifest (``manifest``), the ``OPSD_*`` variables (``env``), the XID
table (``xid_table``), the fake GPUs' files (``gpu_files``), the mesh spec (``mesh``) and the states the API answers
(``states``). Imports nothing of opsd but ``opsd.errors``; everything else may import it."""
