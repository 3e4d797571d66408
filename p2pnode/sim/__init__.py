"""The cluster simulator: a discrete-event mesh of simulated engines in which every node runs the node's own
``Router`` (candidate assembly, policies, speculative index, in-flight ledger), prefix index and plan, for comparing
policies and reproducing the papers' findings. The simulator depends on the node's packages, never the reverse.

Public API (imported from the modules, so that ``import p2pnode.sim.cli`` stays light for the main CLI):
- ``cluster.Cluster(SimConfig(...)).run(requests) -> dict``: one run's metrics (``metrics.py`` defines them);
- ``workloads.get_workloads(name)``, ``workloads.TraceWorkload(path)`` / ``.from_records(...)``: request streams;
- ``runner.run_experiment(Experiment(...))`` and ``report.write_report(...)``: ladders x seeds x policies, and the
  results.json / results.md / PNG report;
- ``cli.add_sim_parser(subparsers)`` / ``cli.run_sim(args)``: ``p2pnode sim``;
- ``replay.replay_log``: the shadow gate's replay (``p2pnode.plan.gate.Replayer``);
- seams: ``views.SimView`` (a ``PeerDirectory`` per ingress: the staleness model, the real agent, exact state),
  ``plan.PlanProvider``, ``p2pnode.cache.eviction.EVICTION_POLICIES``, ``p2pnode.cost.PROFILES``.
See docs/simulator.md.
"""
