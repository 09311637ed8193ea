"""The Kubernetes backend: the Backend port on a cluster whose training jobs are JobSets (``backend``), the client's
calls (``api``), node edits (``nodes``), Events (``events``), informers (``watch``), runs and node roles
(``runs``), leader election (``lease``) and the process (``runner``)."""
