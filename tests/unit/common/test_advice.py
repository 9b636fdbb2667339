from elasticdl.common.advice import config_warnings, effective_batch, effective_batch_note
from elasticdl.common.job_spec import JobSpec


def spec(**kw):
    base = dict(model_zoo="z", model_def="m.f", training_data="d")
    return JobSpec(**{**base, **kw})


def test_thrashing_sync_ps_is_warned_with_the_flags_to_change():
    [w] = config_warnings(spec(distribution_strategy="ParameterServerStrategy",
                                num_workers=2, num_ps_pods=2))
    assert "--grads_to_wait=2" in w and "--sync_version_tolerance=1" in w and "--use_async" in w
    [w] = config_warnings(spec(distribution_strategy="ParameterServerStrategy",
                                num_workers=5, grads_to_wait=2, sync_version_tolerance=1))
    assert "2 version(s) stale" in w


def test_configurations_that_do_not_thrash_are_quiet():
    for kw in (dict(num_workers=2, grads_to_wait=2), dict(num_workers=2, use_async=True),
               dict(num_workers=3, sync_version_tolerance=2), dict(num_workers=1)):
        assert config_warnings(spec(distribution_strategy="ParameterServerStrategy", **kw)) == []
    assert config_warnings(spec(distribution_strategy="AllreduceStrategy", num_workers=4)) == []
    assert config_warnings(spec()) == []


def test_effective_batch_per_strategy():
    assert effective_batch(spec(minibatch_size=32)) == 32
    ar = spec(distribution_strategy="AllreduceStrategy", num_workers=4, minibatch_size=32)
    assert effective_batch(ar) == 128 and "128 records" in effective_batch_note(ar)
    ps = spec(distribution_strategy="ParameterServerStrategy", num_workers=4, grads_to_wait=3,
              minibatch_size=32)
    assert effective_batch(ps) == 96
    assert effective_batch(spec(distribution_strategy="ParameterServerStrategy", num_workers=4,
                                grads_to_wait=3, use_async=True, minibatch_size=32)) == 32
    assert effective_batch_note(spec()) == ""
