"""The cluster simulator: a discrete-event mesh that runs the node's own routing policies, prefix index,
speculative index and plan over simulated engines, for comparing policies and reproducing the papers' findings.

Public API (imported from the modules, so that ``import p2pnode.sim.cli`` stays light for the main CLI):
- ``cluster.Cluster(SimConfig(...)).run(requests) -> dict``: one run's metrics (``metrics.py`` defines them);
- ``workloads.get_workloads(name)``, ``workloads.TraceWorkload(path)`` / ``.from_records(...)``: request streams;
- ``runner.run_experiment(Experiment(...))`` and ``report.write_report(...)``: ladders x seeds x policies, and the
  results.json / results.md / PNG report;
- ``cli.add_sim_parser(subparsers)`` / ``cli.run_sim(args)``: ``p2pnode sim``;
- seams: ``views.SimView`` (gossip: the staleness model today, the real agent later), ``plan.PlanProvider``,
  ``eviction.EVICTION_POLICIES``, ``cost.PROFILES``.
See docs/simulator.md.
"""
