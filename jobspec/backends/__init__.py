"""Each backend's section of job.yaml (`local:`, `slurm:`, `k8s:`): its options, checked by its
own pydantic model, and the facts about its hosts that the job spec needs (how many host
processes, devices per host, whether they see this machine's paths).

Here, not in `launch/backends/<name>/` (which owns each backend's behaviour), because `jobspec`
is the contract both `launch` and `runtime` read and never imports `launch`.
"""
