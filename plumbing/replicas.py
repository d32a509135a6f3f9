"""Which ranks hold copies of a parameter, for 04's BucketedDDP: its data-parallel group, or the group
the parameter carries as .replica_group (09's experts, whose copies are over edp, not dp). 04 imports
by_replicas back, so `data_parallel.by_replicas` is where it was; plumbing/checkpoint.py and 05 read the
same attribute."""


def by_replicas(params, group):
    """{group: its parameters, in the order given}, for BucketedDDP: a gradient is summed over the ranks holding
    copies of it, `group` (dp) unless it carries another as .replica_group (09's experts: edp); always divided by dp."""
    out = {}
    for p in params:
        out.setdefault(getattr(p, "replica_group", group), []).append(p)
    return out
