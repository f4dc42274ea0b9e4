#!/usr/bin/env python3
"""Train a small CNN on scikit-learn's handwritten digits with PopTorch.

The data set (``sklearn.datasets.load_digits``) holds 1 797 grey-scale images of
8×8 pixels, 10 classes. It ships with scikit-learn, so this example needs no download.

What the example shows:

* a model whose ``forward`` returns ``(logits, loss)`` when given labels, so the same
  module serves ``poptorch.trainingModel`` (which needs the loss) and
  ``poptorch.inferenceModel`` (which only needs the logits);
* ``poptorch.Options`` with ``deviceIterations`` and
  ``Training.gradientAccumulation``: each call of the training model runs
  ``deviceIterations`` weight updates, each of them accumulating the gradients of
  ``gradientAccumulation`` micro-batches;
* ``poptorch.DataLoader``, which yields *combined* batches of
  ``micro-batch × deviceIterations × gradientAccumulation`` samples — exactly what one
  call of the model consumes;
* ``Options().randomSeed(...)`` for reproducible runs (it also seeds PyTorch on the
  host, and the DataLoader shuffles with a generator derived from it);
* evaluation on a held-out split with ``poptorch.inferenceModel``, covering every test
  sample exactly once.

Run::

    python examples/digits.py                # 20 epochs, prints the loss per epoch
    python examples/digits.py --epochs 5 --seed 3
    python examples/digits.py --threads 2    # PyTorch intra-op threads (default: 1 here)

Threads: the IPU Model runs the graph with PyTorch's CPU kernels. For a model this small
(about 6 k parameters) one thread is fastest: the kernels are too small to split, and on
a busy machine OpenMP's synchronisation between contended threads makes each of them
many times slower (the default 20 epochs took 108 s with 2 contended threads, 10 s with
one). :func:`default_threads` picks one thread below a million parameters and PyTorch's
default above; ``--threads N`` (or ``OMP_NUM_THREADS=N``) overrides it.
"""
import argparse
import time
from typing import Callable, Optional, Tuple

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import poptorch

#: Default hyper-parameters. One call of the training model consumes
#: MICRO_BATCH × DEVICE_ITERATIONS × GRADIENT_ACCUMULATION = 16 × 4 × 2 = 128 samples
#: and performs DEVICE_ITERATIONS = 4 optimizer steps, each over 2 × 16 = 32 samples.
MICRO_BATCH = 16
DEVICE_ITERATIONS = 4
GRADIENT_ACCUMULATION = 2
LEARNING_RATE = 0.01
EPOCHS = 20

#: Below this many parameters the example runs PyTorch on one intra-op thread.
SMALL_MODEL_PARAMETERS = 1_000_000

#: Inference arrangement. The split below leaves 360 test images; one call of the
#: inference model takes EVAL_MICRO_BATCH × EVAL_DEVICE_ITERATIONS = 18 × 4 = 72 images,
#: which divides 360 exactly, so five calls cover every test image once (see evaluate()).
EVAL_MICRO_BATCH = 18
EVAL_DEVICE_ITERATIONS = 4


def load_data(test_size: float = 0.2, random_state: int = 0
              ) -> Tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    """Load the digits and split them into a training and a test set.

    The split is stratified and fixed by ``random_state``, so every run (and every
    seed given to :func:`train`) sees the same held-out images.

    Args:
        test_size: fraction of the 1 797 images held out for testing (0.2 → 360).
        random_state: seed of the split.

    Returns:
        ``(train_set, test_set)``: ``TensorDataset``s of ``(image, label)`` with
        images as ``float32 [1, 8, 8]`` scaled to ``[0, 1]`` and labels as ``int64``.
    """
    digits = load_digits()
    # Pixel values are integers in [0, 16]; add a channel dimension for Conv2d.
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=test_size, random_state=random_state, stratify=labels)
    return (torch.utils.data.TensorDataset(x_train, y_train),
            torch.utils.data.TensorDataset(x_test, y_test))


class DigitsCNN(torch.nn.Module):
    """A small CNN for 1×8×8 images: two conv/ReLU/max-pool stages and a linear
    classifier (about 6 k parameters).

    ``forward(images)`` returns the logits; ``forward(images, labels)`` returns
    ``(logits, loss)`` with a mean cross-entropy loss. PopTorch's training model needs
    the loss to be returned; it runs the backward pass and the optimizer itself.

    The model deliberately has no dropout or batch norm: it stays deterministic, which
    lets the tests compare PopTorch's weights with a plain PyTorch loop exactly.
    """

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(1, 16, kernel_size=3, padding=1),   # 16 × 8 × 8
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),                              # 16 × 4 × 4
            torch.nn.Conv2d(16, 32, kernel_size=3, padding=1),  # 32 × 4 × 4
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),                              # 32 × 2 × 2
        )
        self.classifier = torch.nn.Linear(32 * 2 * 2, num_classes)
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, images: torch.Tensor, labels: Optional[torch.Tensor] = None):
        """Logits of ``images``; with ``labels`` also the mean cross-entropy loss."""
        logits = self.classifier(torch.flatten(self.features(images), 1))
        if labels is None:
            return logits
        return logits, self.loss(logits, labels)


def training_options(seed: int, device_iterations: int = DEVICE_ITERATIONS,
                     gradient_accumulation: int = GRADIENT_ACCUMULATION,
                     show_progress: bool = True) -> poptorch.Options:
    """The ``poptorch.Options`` used for training.

    Args:
        seed: random seed (device RNG, host ``torch.manual_seed`` and DataLoader
            shuffling).
        device_iterations: optimizer steps per call of the training model.
        gradient_accumulation: micro-batches whose gradients are accumulated per step.
            PopTorch's default ``Mean`` reduction averages them, so one step sees the
            mean gradient over ``gradient_accumulation × micro-batch`` samples.
        show_progress: draw the "Graph compilation" progress bar.

    Returns:
        The options (the output mode is ``All`` so that every micro-batch's loss and
        logits come back, not only the last one).
    """
    opts = poptorch.Options()
    opts.randomSeed(seed)
    opts.deviceIterations(device_iterations)
    opts.Training.gradientAccumulation(gradient_accumulation)
    # Training models return only the last micro-batch's outputs by default
    # (OutputMode.Final); ask for all of them to report the mean loss of an epoch.
    opts.outputMode(poptorch.OutputMode.All)
    opts.showCompilationProgressBar(show_progress)
    return opts


def make_train_loader(options: poptorch.Options, dataset: torch.utils.data.Dataset,
                      micro_batch: int = MICRO_BATCH,
                      progress_bar: bool = False) -> poptorch.DataLoader:
    """A shuffling ``poptorch.DataLoader`` yielding combined training batches.

    Each element has ``micro_batch × deviceIterations × gradientAccumulation`` rows
    (``loader.combinedBatchSize``). ``drop_last`` keeps its default ``True``: the
    training model is compiled for that exact batch size. With a random seed in
    ``options`` the shuffling is reproducible, and the images dropped each epoch
    change from epoch to epoch. ``progress_bar=True`` draws a tqdm bar for each epoch
    (the library's default is off).
    """
    return poptorch.DataLoader(options, dataset, batch_size=micro_batch, shuffle=True,
                               progress_bar=progress_bar)


def train(model: torch.nn.Module, dataset: torch.utils.data.Dataset, epochs: int = EPOCHS,
          seed: int = 0, lr: float = LEARNING_RATE, micro_batch: int = MICRO_BATCH,
          device_iterations: int = DEVICE_ITERATIONS,
          gradient_accumulation: int = GRADIENT_ACCUMULATION, verbose: bool = True,
          on_step: Optional[Callable[..., None]] = None,
          progress_bar: bool = False) -> torch.nn.Module:
    """Train ``model`` on ``dataset`` with ``poptorch.trainingModel``.

    Args:
        model: a module whose ``forward(images, labels)`` returns ``(logits, loss)``.
        dataset: ``(image, label)`` pairs.
        epochs: passes over the data.
        seed: random seed (see :func:`training_options`).
        lr: Adam learning rate.
        micro_batch: samples per forward/backward pass.
        device_iterations: optimizer steps per call of the training model.
        gradient_accumulation: micro-batches accumulated per optimizer step.
        verbose: print the mean loss and accuracy of each epoch and show the
            compilation progress bar.
        on_step: optional callback, called after every call of the training model as
            ``on_step(epoch, images, labels, logits, losses)`` with the combined batch
            and the outputs of all its micro-batches (useful for custom metrics).
        progress_bar: draw a tqdm progress bar while iterating each epoch.

    Returns:
        ``model`` itself, holding the trained weights (the training wrapper is
        destroyed, which copies the weights back to the host).

    Raises:
        ValueError: ``epochs`` < 1, or ``dataset`` smaller than one combined batch.
    """
    combined = micro_batch * device_iterations * gradient_accumulation
    if epochs < 1 or len(dataset) < combined:
        raise ValueError(f"need epochs >= 1 (got {epochs}) and at least one combined "
                         f"batch of {combined} samples (got {len(dataset)})")
    opts = training_options(seed, device_iterations, gradient_accumulation,
                            show_progress=verbose)
    loader = make_train_loader(opts, dataset, micro_batch, progress_bar)
    # PopTorch never calls train()/eval(): set the mode before wrapping.
    model.train()
    # Passing lr explicitly makes it a *variable* hyper-parameter (it could be changed
    # later with setOptimizer() without recompiling); unpassed ones are constants.
    optimizer = poptorch.optim.Adam(model.parameters(), lr=lr)
    training_model = poptorch.trainingModel(model, options=opts, optimizer=optimizer)

    for epoch in range(1, epochs + 1):
        start = time.perf_counter()
        loss_sum, correct, seen, steps = 0.0, 0, 0, 0
        for images, labels in loader:
            # One call = device_iterations optimizer steps. The first call also
            # captures and compiles the model. With OutputMode.All, `logits` has one
            # row per sample of the combined batch and `losses` one value per
            # micro-batch (computed with the weights before that step's update).
            logits, losses = training_model(images, labels)
            loss_sum += float(losses.sum())
            steps += losses.numel()
            correct += int((logits.argmax(dim=1) == labels).sum())
            seen += labels.numel()
            if on_step is not None:
                on_step(epoch, images, labels, logits, losses)
        if verbose:
            print(f"epoch {epoch:3d}/{epochs}  loss {loss_sum / max(steps, 1):.4f}  "
                  f"train accuracy {correct / max(seen, 1):6.2%}  "
                  f"({time.perf_counter() - start:.2f} s)")

    # Copy the weights back to `model` and release the device; `model` is a plain
    # torch.nn.Module again.
    training_model.destroy()
    return model


def evaluate(model: torch.nn.Module, dataset: torch.utils.data.Dataset,
             micro_batch: int = EVAL_MICRO_BATCH,
             device_iterations: int = EVAL_DEVICE_ITERATIONS) -> float:
    """Classification accuracy of ``model`` on ``dataset`` with ``poptorch.inferenceModel``.

    The inference model is compiled for one combined batch size,
    ``micro_batch × device_iterations``. A ``poptorch.DataLoader`` with the default
    ``drop_last=True`` would silently skip the remainder of the data set, and a final
    short batch (``drop_last=False``) would not match the compiled input shape. We
    therefore choose a combined batch size that divides the number of test samples
    (72 divides 360), pass ``drop_last=False`` and check that every sample was scored.

    Args:
        model: the (trained) model; ``model(images)`` must return logits.
        dataset: ``(image, label)`` pairs; its length must be a multiple of
            ``micro_batch × device_iterations``.
        micro_batch: samples per forward pass.
        device_iterations: forward passes per call of the inference model.

    Returns:
        The fraction of correctly classified samples.

    Raises:
        ValueError: ``len(dataset)`` is not a multiple of the combined batch size.
    """
    combined = micro_batch * device_iterations
    if len(dataset) % combined:
        raise ValueError(f"{len(dataset)} samples cannot be split into whole combined "
                         f"batches of {micro_batch} × {device_iterations} = {combined}; "
                         "choose a micro-batch size / deviceIterations that divides it")
    opts = poptorch.Options().deviceIterations(device_iterations)
    opts.showCompilationProgressBar(False)
    loader = poptorch.DataLoader(opts, dataset, batch_size=micro_batch, shuffle=False,
                                 drop_last=False)
    model.eval()
    inference_model = poptorch.inferenceModel(model, opts)
    correct = seen = 0
    for images, labels in loader:
        logits = inference_model(images)  # OutputMode.All (default): one row per image
        correct += int((logits.argmax(dim=1) == labels).sum())
        seen += labels.numel()
    inference_model.destroy()
    assert seen == len(dataset), f"evaluated {seen} of {len(dataset)} samples"
    return correct / seen


def default_threads(model: torch.nn.Module) -> int:
    """PyTorch intra-op threads suited to ``model``: 1 below
    :data:`SMALL_MODEL_PARAMETERS` parameters (their kernels are too small to gain from
    a second thread, and contended threads slow them down), else PyTorch's default
    (``torch.get_num_threads()``, which honours ``OMP_NUM_THREADS``)."""
    parameters = sum(p.numel() for p in model.parameters())
    return 1 if parameters < SMALL_MODEL_PARAMETERS else torch.get_num_threads()


def main(argv=None) -> float:
    """Command-line entry point: train, evaluate, print the test accuracy.

    Returns:
        The test accuracy (also printed).
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=EPOCHS,
                        help=f"passes over the training data (default {EPOCHS})")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--lr", type=float, default=LEARNING_RATE,
                        help=f"Adam learning rate (default {LEARNING_RATE})")
    parser.add_argument("--quiet", action="store_true",
                        help="only print the final test accuracy")
    parser.add_argument("--progress", action="store_true",
                        help="show a tqdm progress bar while iterating each epoch")
    parser.add_argument("--threads", type=int, default=None,
                        help="PyTorch intra-op threads (default: 1 for this small model, "
                        "see default_threads())")
    args = parser.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be at least 1")

    start = time.perf_counter()
    train_set, test_set = load_data()
    # Seed before building the model so that its initial weights are reproducible.
    torch.manual_seed(args.seed)
    model = DigitsCNN()
    threads = args.threads or default_threads(model)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    if not args.quiet:
        print(f"{len(train_set)} training / {len(test_set)} test images; "
              f"micro-batch {MICRO_BATCH}, deviceIterations {DEVICE_ITERATIONS}, "
              f"gradientAccumulation {GRADIENT_ACCUMULATION}, {threads} thread(s)")
    try:
        model = train(model, train_set, epochs=args.epochs, seed=args.seed, lr=args.lr,
                      verbose=not args.quiet, progress_bar=args.progress)
        accuracy = evaluate(model, test_set)
    finally:
        torch.set_num_threads(previous_threads)
    print(f"test accuracy: {accuracy:.2%} ({len(test_set)} images, "
          f"{time.perf_counter() - start:.1f} s)")
    return accuracy


if __name__ == "__main__":
    main()
