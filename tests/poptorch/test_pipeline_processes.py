"""A pipelined model runs each pipeline stage in its own process
(``Options.Distributed.pipelineAcrossProcesses``, issue 24) and trains exactly like the
single-process IPU Model run: 2 and 4 processes on 127.0.0.1 (gloo), compared with one
process; faults; what the mode refuses."""
import os
import sys

import pytest
import torch

import poptorch
import processes
from popart_compiler.config import JOIN_TIMEOUT_ENV
from popart_compiler.runtime import collectives

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "pipeline_worker.py")
TOL = dict(rtol=1e-5, atol=1e-6)


def _worker():
    return processes.load_worker(WORKER)


def _compare(name, got, reference, rank, replica=0, pipelines=1, cfg=None):
    outputs, state, ipu_state = reference
    g_outputs, g_state, g_ipu_state = got
    assert g_state.keys() == state.keys()
    for key, value in state.items():
        torch.testing.assert_close(g_state[key], value, **TOL,
                                   msg=f"{name}: {key} in process {rank}")
    assert g_ipu_state.keys() == ipu_state.keys(), name
    for key, value in ipu_state.items():
        torch.testing.assert_close(g_ipu_state[key], value, **TOL,
                                   msg=f"{name}: optimizer state {key} in process {rank}")
    for call, (mine, ref) in enumerate(zip(g_outputs, outputs)):
        for k, (m, r) in enumerate(zip(mine, ref)):
            if pipelines > 1:  # this pipeline's replicas of [D, A, R, ...] results
                d, a, reps = cfg["d"], cfg["a"], cfg["r"]
                part = reps // pipelines
                r = r.reshape(d, a, reps, -1)[:, :, replica * part:(replica + 1) * part]
                m = m.reshape(r.shape)
            torch.testing.assert_close(m, r, **TOL,
                                       msg=f"{name}: output {k} of call {call}, process {rank}")


def _check_configs(tmp_path, configs, world):
    worker = _worker()
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for name, cfg in configs.items():
        reference = worker.train(cfg, False)
        for rank in range(world):
            _compare(name, results[rank][name], reference, rank,
                     replica=rank // cfg["stages"], pipelines=cfg.get("pipelines", 1),
                     cfg=cfg)
    return results


def test_two_stages_on_two_processes_train_like_one_process(tmp_path):
    """SGD with momentum and weight decay, Adam with Sum reduction and 2 local
    replicas, LAMB with the Running mean, the combined SGD variant, both SGD variants
    clipping the global gradient norm; device iterations, gradient accumulation,
    every output mode; a head tied to the embedding of the other stage (one gradient
    sum, one update); BatchNorm buffers; values crossing both stages (a skip
    connection, a boolean mask). Process 1 starts from other weights: process 0's are
    broadcast. Weights, optimizer state and outputs equal the single-process run in
    every process. Then: a checkpoint saved by process 0 alone (implicit reads of both
    stages' weights), copyWeightsToHost in process 1 alone, the checkpoint resumed in a
    new model, pipelined inference (output modes All and Sum), destroy(), and the
    executable saved after the first call (``save``) loaded with ``poptorch.load`` for
    the second call."""
    codes, logs = processes.launch(WORKER, "train", tmp_path, world=2)
    assert codes == [0, 0], logs
    results = _check_configs(tmp_path, _worker().CONFIGS, 2)
    reference = _worker().host_reference()
    for rank in range(2):
        host = results[rank]["host"]
        for key in ("after_two", "resumed_two", "resumed_three", "loaded_two"):
            for name, value in reference[key].items():
                torch.testing.assert_close(host[key][name], value, **TOL,
                                           msg=f"{key} {name} process {rank}")
        assert set(host["inference"]) == {"All", "Sum"}
        for mode, (logits, loss) in reference["inference"].items():
            torch.testing.assert_close(host["inference"][mode][0], logits, **TOL)
            torch.testing.assert_close(host["inference"][mode][1], loss, **TOL)
        assert reference["inference"]["All"][0].shape == (4, 10)
        assert reference["inference"]["Sum"][0].shape == (2, 10)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs 2 cores to pin 2 processes")
def test_pinned_stage_processes_train_like_one_process(tmp_path):
    """POPTORCH_PIPELINE_PIN_CORES=1: each of the 2 stage processes runs, all its
    threads, on one core of its own (the first and second allowed), and trains as the
    single process does."""
    codes, logs = processes.launch(WORKER, "pinned", tmp_path, world=2,
                                   POPTORCH_PIPELINE_PIN_CORES="1")
    assert codes == [0, 0], logs
    cfg = _worker().CONFIGS["sgd_bn"]
    results = _check_configs(tmp_path, {"sgd_bn": cfg}, 2)
    allowed = sorted(os.sched_getaffinity(0))
    for rank in range(2):
        assert results[rank]["affinity"] == [allowed[rank]]
        assert results[rank]["thread_affinities"] == [(allowed[rank],)]


def test_four_processes_four_stages_and_two_pipelines(tmp_path):
    """4 processes: a 4-stage pipeline with a weight tied across stages 0 and 3
    (Adam), then 2 data-parallel pipelines of 2 stages (a 2-D mesh) compared with one
    process running both replicas."""
    codes, logs = processes.launch(WORKER, "train4", tmp_path, world=4)
    assert codes == [0] * 4, logs
    _check_configs(tmp_path, _worker().CONFIGS_4, 4)


@pytest.mark.parametrize("fault, code, said", [
    ("raise", 1, "ended with RuntimeError: stage 1 failed on purpose (uncaught, exit "
     "status 1)"),
    ("exit", 1, "exited with status 1 (sys.exit(1)) after catching RuntimeError: stage 1 "
     "failed on purpose"),
    ("die", 3, "exited with status 3 (os._exit(3)) without an error being raised")])
def test_failed_stage_makes_the_other_fail_naming_it(tmp_path, fault, code, said):
    """With the default collective timeout (300 s): stage 1 raising, catching its error
    and calling sys.exit(1) (issue 29 item 4: reported as "ended normally"), or dying,
    makes stage 0 fail within seconds with an error naming stage 1, its exit status
    and whether it raised."""
    codes, logs = processes.launch(WORKER, fault, tmp_path, world=2,
                                   **{collectives.TIMEOUT_ENV: ""})
    assert codes == [0, code], logs
    message = processes.read(tmp_path, 0)
    seconds = float(message.split("s ", 1)[0])
    assert seconds < collectives.DEFAULT_TIMEOUT_S, message  # not the timeout, however slow
    assert "within the collective timeout" not in message
    assert "ended normally" not in message
    assert "failed in process 0 of 2 (pipeline stage 0 of 2 (IPU 0))" in message
    assert f"Process 1 of 2 (pipeline stage 1 of 2 (IPU 1)) {said}" in message, message


def test_process_ending_normally_makes_the_one_waiting_in_a_call_fail(tmp_path,
                                                                      monkeypatch):
    """Process 1 ends its script after 1 call while process 0 makes a 2nd: both hung
    (process 1 in gloo at exit, process 0 in the call). Now process 0 fails within
    seconds naming process 1 and the mismatched calls, and both exit. Then the
    executable saved by process 0 of that run, loaded in this single process (no
    launcher), raises the error a new model gets (it waited in the rendezvous)."""
    codes, logs = processes.launch(WORKER, "mismatched_calls", tmp_path, world=2,
                                   **{collectives.TIMEOUT_ENV: ""})
    assert codes == [0, 0], logs
    message = processes.read(tmp_path, 0)
    seconds = float(message.split("s ", 1)[0])
    assert seconds < collectives.DEFAULT_TIMEOUT_S, message  # not the timeout
    assert "Distributed pipeline step failed in process 0 of 2 (pipeline stage 0 of 2 " \
        "(IPU 0)): Process 1 of 2 (pipeline stage 1 of 2 (IPU 1)) ended normally (its " \
        "script finished, exit status 0) after 1 pipeline call while process 0 of 2 " \
        "(pipeline stage 0 of 2 (IPU 0)) waits in pipeline call 2: every process of the " \
        "pipeline must make the same calls" in message
    if collectives.dist.is_initialized():
        pytest.skip("a process group already exists in this test process")
    for name in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                 "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(poptorch.Error, match=r"this model runs as 2 pipeline stages, one "
                       r"per process, but only 1 process was started: launch one "
                       r"process per stage"):
        poptorch.load(str(tmp_path / "model0.poptorch"))
    assert not collectives.dist.is_initialized()


def test_loaded_file_runs_as_the_loading_process(monkeypatch):
    """A file of process 1 of 2, loaded without a launcher: a pipeline takes this
    process's place (process 0 of 1, then refused as a new model is); a replicated
    run is refused naming both."""
    from poptorch._files.processes import adopt_processes
    if collectives.dist.is_initialized():
        pytest.skip("a process group already exists in this test process")
    for name in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("POPTORCH_PIPELINE_ACROSS_PROCESSES", raising=False)
    opts = poptorch.Options()
    opts.Distributed.configureProcessId(1, 2).pipelineAcrossProcesses()
    adopt_processes("f.poptorch", opts)
    assert (opts.Distributed.processId, opts.Distributed.numProcesses) == (0, 1)
    opts = poptorch.Options()
    opts.Distributed.configureProcessId(1, 2)
    with pytest.raises(poptorch.Error, match=r"f.poptorch was saved by process 1 of 2 of "
                       r"a distributed run, but this is process 0 of 1 \(no launcher\): "
                       r"load it in process 1 of a run of 2 processes"):
        adopt_processes("f.poptorch", opts)
    adopt_processes("f.poptorch", opts, training=False)  # inference: loads anywhere
    assert (opts.Distributed.processId, opts.Distributed.numProcesses) == (1, 2)


def _torchrun(scenario, tmp_path, **extra_env):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(processes.free_port()), WORKER, scenario, str(tmp_path)]
    codes, logs = processes.run([cmd], [processes.env(**extra_env)])
    assert codes == [0], logs
    return processes.read(tmp_path, 0)


def test_process_ending_without_joining_makes_the_other_fail(tmp_path):
    """Under torchrun, only process 0 runs a pipelined inference model; process 1 ends
    its script at once. Process 0 waited in the rendezvous until its timeout; now it
    fails within seconds naming process 1 and its exit status."""
    message = _torchrun("inference_in_process_0", tmp_path,
                        **{collectives.TIMEOUT_ENV: ""})
    seconds = float(message.split("s ", 1)[0])
    assert seconds < collectives.DEFAULT_TIMEOUT_S, message  # not the timeout
    assert "Process 0 of 2 could not join the other processes: process 1 of 2 ended " \
        "normally (its script finished, exit status 0) without joining the run" in message
    assert "every process must make the same calls" in message


def test_process_never_joining_is_detected_within_the_timeout(tmp_path):
    """Issue 29 item 6: under torchrun, a process that stays alive without joining was
    detected after 87 s with a 45 s timeout (the rendezvous waited the timeout, then
    init_process_group waited it again). Now process 0 fails once the timeout set has
    passed (from the start of its join; twice that was the fault), naming process 1."""
    timeout = round(10 * processes.time_scale())
    message = _torchrun("never_join", tmp_path, **{collectives.TIMEOUT_ENV: str(timeout),
                                                   JOIN_TIMEOUT_ENV: ""})
    seconds = float(message.split("s ", 1)[0])
    assert timeout <= seconds < 2 * timeout, message
    assert f"Process 0 of 2 could not join the other processes: process 1 of 2 did not " \
        f"come to join the run within {timeout} s (the join timeout: " \
        "POPTORCH_DISTRIBUTED_JOIN_TIMEOUT, else POPTORCH_DISTRIBUTED_TIMEOUT)" in message


# -- what the mode refuses: a clear error before any process waits ----------------------

def _refused(model, opts, *args):
    training = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(),
                                                                      lr=0.1))
    with pytest.raises(poptorch.Error) as info:
        training(*args)
    return str(info.value)


def _data():
    cfg = _worker().CONFIGS["sgd_bn"]
    return [t.reshape(-1, *t.shape[4:]) for t in _worker().global_data(cfg, 0)]


def _opts(world=2):
    return _worker().options(_worker().CONFIGS["sgd_bn"], True, world, 0)


def test_refused_one_process():
    message = _refused(_worker().Blocks(2), _opts(world=1), *_data())
    assert "this model runs as 2 pipeline stages, one per process, but only 1 process " \
        "was started: launch one process per stage, e.g. torchrun" in message


def test_refused_stage_count_mismatch():
    opts = _opts()
    opts.Distributed.pipelineAcrossProcesses(stages=1)
    message = _refused(_worker().Blocks(2), opts, *_data())
    assert "this model runs as 2 pipeline stages (IPU 0 → IPU 1; consecutive stages on " \
        "one IPU run as one), one process each, but 1 processes per pipeline were " \
        "declared. Start 2 processes per pipeline replica" in message


def test_refused_single_stage_and_sharded_models():
    opts = _opts()
    opts.setExecutionStrategy(poptorch.ShardedExecution())
    message = _refused(_worker().Blocks(2), opts, *_data())
    assert "runs each pipeline stage in its own process, but this model is not " \
        "pipelined (sharded or phased execution)" in message

    class OneStage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)

        def forward(self, x, t):
            return torch.nn.functional.mse_loss(self.lin(x), t)

    message = _refused(OneStage(), _opts(), torch.ones(12, 3), torch.zeros(12, 2))
    assert "but this model has one pipeline stage: place its blocks on several IPUs " \
        "(poptorch.BeginBlock(..., ipu_id=k)) with PipelinedExecution" in message


def test_refused_state_anchors():
    opts = _opts()
    opts.anchorTensor("grad", "Gradient___blocks.0.weight")
    message = _refused(_worker().Blocks(2), opts, *_data())
    assert "cannot anchor weights, gradients or optimizer state " \
        "(Gradient___blocks.0.weight)" in message


def test_option_and_environment_variable(monkeypatch):
    opts = poptorch.Options()
    assert opts.Distributed.pipelineProcessesPerReplica == 1
    opts.Distributed.configureProcessId(1, 4).pipelineAcrossProcesses(stages=2)
    assert opts.Distributed.pipelineProcessesPerReplica == 2
    opts.Distributed.pipelineAcrossProcesses()
    assert opts.Distributed.pipelineProcessesPerReplica == 4
    with pytest.raises(ValueError):
        opts.Distributed.pipelineAcrossProcesses(stages=0)
    monkeypatch.setenv("POPTORCH_PIPELINE_ACROSS_PROCESSES", "1")
    opts = poptorch.Options()
    opts.Distributed.configureProcessId(0, 2)
    assert opts.Distributed.pipelineProcessesPerReplica == 2


# -- a pipelined BERT from Graphcore's examples, as a new user runs it ----------------

BERT = os.path.join(processes.ROOT, "examples", "pipelined_bert.py")


def test_pipelined_bert_example_on_two_processes(tmp_path):
    """``examples/pipelined_bert.py`` (Hugging Face BertForSequenceClassification over
    2 IPUs with BeginBlock, as in Graphcore's examples), unchanged, launched as
    torchrun would with ``POPTORCH_PIPELINE_ACROSS_PROCESSES=1``: both processes print
    the single-process losses and hold its final weights."""
    port = str(processes.free_port())
    envs = [processes.env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                          POPTORCH_PIPELINE_ACROSS_PROCESSES="1") for r in range(2)]
    cmd = [sys.executable, BERT, "--epochs", "1", "--out", str(tmp_path)]
    codes, logs = processes.run([cmd, cmd], envs)
    assert codes == [0, 0], logs
    reference = processes.load_worker(BERT).train(epochs=1)
    assert len(reference["losses"]) == 4
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        torch.testing.assert_close(torch.tensor(got["losses"]),
                                   torch.tensor(reference["losses"]), **TOL)
        assert got["weights"].keys() == reference["weights"].keys()
        for key, value in reference["weights"].items():
            torch.testing.assert_close(got["weights"][key], value, **TOL,
                                       msg=f"{key} in process {rank}")
        assert "epoch 0: loss" in logs[rank]
