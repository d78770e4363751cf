"""`pdserve profile` and `pdserve plan`: fit a worker's step latencies (profile, measure), then simulate a
router with prefill and decode pools on a workload (simulator) to choose the P:D split and pool size that
give the most goodput per worker (plan)."""
