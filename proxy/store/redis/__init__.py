"""The ``redis`` backend: one transcript tree shared by every worker and host, behind a local cache."""
