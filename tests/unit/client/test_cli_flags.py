"""The job commands' flags parsed without python-fire: the same JobSpec as fire gave."""

from elasticdl.common.job_spec import job_spec_from_flags
from elasticdl_client.main import parse_job_flags


def test_forms_of_flags():
    flags = parse_job_flags(["--model_zoo=zoo", "--model_def", "a.b", "--num_epochs=3",
                             "--shuffle", "--nogrpc_tls", "--job-name=007",
                             "--model_params=k=1;j=2", "--envs=A=1,B=2", "--training_data=d"])
    assert flags == {"model_zoo": "zoo", "model_def": "a.b", "num_epochs": "3",
                     "shuffle": True, "grpc_tls": False, "job_name": "007",
                     "model_params": "k=1;j=2", "envs": "A=1,B=2", "training_data": "d"}
    spec = job_spec_from_flags("train", flags)
    assert (spec.num_epochs, spec.shuffle, spec.grpc_tls, spec.job_name) == (3, True, False,
                                                                            "007")
    assert job_spec_from_flags("train", parse_job_flags(["--model_zoo=z", "--model_def=a.b",
                                                         "--training_data=d",
                                                         "--shuffle=false"])).shuffle is False


def test_help_and_fire_flags_go_to_fire():
    assert parse_job_flags(["--help"]) is None
    assert parse_job_flags(["-h"]) is None
    assert parse_job_flags(["--model_zoo=z", "--", "--trace"]) is None
