"""Certify a randomized-smoothing classifier on CIFAR-10 with every GPU of a node.

The test set (every --skip-th image) is dealt out round-robin to the ranks.
No gradient synchronisation is needed, so the base classifier is not wrapped
in DDP; the process group is only used to gather the per-rank summaries.
Each rank writes its own part file; rank 0 merges them at the end.

    torchrun --standalone --nproc_per_node=4 13_certify_sharded.py \
        models/cifar10/resnet110/noise_0.25/checkpoint.pth.tar 0.25 \
        certify/cifar10/resnet110/noise_0.25/test/sigma_0.25 --skip 20 --batch 400
"""
import argparse
import datetime
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from scipy.stats import binomtest, norm
from statsmodels.stats.proportion import proportion_confint

from architectures import get_architecture
from datasets import get_dataset, get_num_classes

parser = argparse.ArgumentParser(description="Certify many examples")
parser.add_argument("base_classifier", type=str, help="path to saved pytorch model of base classifier")
parser.add_argument("sigma", type=float, help="noise hyperparameter")
parser.add_argument("outfile", type=str, help="output file")
parser.add_argument("--dataset", default="cifar10")
parser.add_argument("--batch", type=int, default=1000, help="batch size")
parser.add_argument("--skip", type=int, default=1, help="how many examples to skip")
parser.add_argument("--max", type=int, default=-1, help="stop after this many examples")
parser.add_argument("--split", choices=["train", "test"], default="test")
parser.add_argument("--N0", type=int, default=100)
parser.add_argument("--N", type=int, default=100000, help="number of samples to use")
parser.add_argument("--alpha", type=float, default=0.001, help="failure probability")
parser.add_argument("--seed", type=int, default=0)


class Smooth:
    ABSTAIN = -1

    def __init__(self, base_classifier, num_classes, sigma, device):
        self.base_classifier = base_classifier
        self.num_classes = num_classes
        self.sigma = sigma
        self.device = device

    def certify(self, x, n0, n, alpha, batch_size):
        self.base_classifier.eval()
        counts_selection = self._sample_noise(x, n0, batch_size)
        c_a = int(counts_selection.argmax())
        counts_estimation = self._sample_noise(x, n, batch_size)
        n_a = int(counts_estimation[c_a])
        p_a = proportion_confint(n_a, n, alpha=2 * alpha, method="beta")[0]
        if p_a < 0.5:
            return Smooth.ABSTAIN, 0.0
        return c_a, self.sigma * norm.ppf(p_a)

    def predict(self, x, n, alpha, batch_size):
        self.base_classifier.eval()
        counts = self._sample_noise(x, n, batch_size)
        top2 = counts.argsort()[::-1][:2]
        count1, count2 = counts[top2[0]], counts[top2[1]]
        if binomtest(int(count1), int(count1 + count2), p=0.5).pvalue > alpha:
            return Smooth.ABSTAIN
        return int(top2[0])

    def _sample_noise(self, x, num, batch_size):
        with torch.no_grad():
            counts = np.zeros(self.num_classes, dtype=int)
            for start in range(0, num, batch_size):
                this_batch = min(batch_size, num - start)
                batch = x.repeat((this_batch, 1, 1, 1))
                noise = torch.randn_like(batch, device=self.device) * self.sigma
                predictions = self.base_classifier(batch + noise).argmax(1)
                counts += np.bincount(predictions.cpu().numpy(), minlength=self.num_classes)
            return counts


def main():
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # ranks may finish minutes apart; do not let the final gather time out
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=12))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed * 1000 + rank)

    checkpoint = torch.load(args.base_classifier, map_location=device)
    base_classifier = get_architecture(checkpoint["arch"], args.dataset)
    state = checkpoint["state_dict"]
    if next(iter(state)).startswith("module."):
        state = {k[len("module."):]: v for k, v in state.items()}
    base_classifier.load_state_dict(state)
    base_classifier.to(device).eval()

    smoothed = Smooth(base_classifier, get_num_classes(args.dataset), args.sigma, device)
    dataset = get_dataset(args.dataset, args.split)
    all_idx = [i for i in range(0, len(dataset), args.skip)]
    if args.max > 0:
        all_idx = all_idx[: args.max]
    my_idx = all_idx[rank::world_size]

    if rank == 0:
        os.makedirs(os.path.dirname(args.outfile) or ".", exist_ok=True)
    dist.barrier()

    part_file = f"{args.outfile}.rank{rank}"
    results = []
    with open(part_file, "w") as f:
        for n_done, i in enumerate(my_idx):
            x, label = dataset[i]
            before = time.time()
            x = x.to(device)
            prediction, radius = smoothed.certify(x, args.N0, args.N, args.alpha, args.batch)
            elapsed = time.time() - before
            correct = int(prediction == label)
            results.append((i, label, prediction, radius, correct, elapsed))
            f.write(f"{i}\t{label}\t{prediction}\t{radius:.3}\t{correct}\t"
                    f"{datetime.timedelta(seconds=elapsed)}\n")
            f.flush()
            if n_done % 10 == 0:
                print(f"[rank {rank}] {n_done + 1}/{len(my_idx)} done", flush=True)

    local_summary = {
        "n": len(results),
        "correct": sum(r[4] for r in results),
        "abstain": sum(int(r[2] == Smooth.ABSTAIN) for r in results),
        "radius_correct": [r[3] for r in results if r[4]],
        "time": sum(r[5] for r in results),
    }
    gathered = [None] * world_size
    dist.all_gather_object(gathered, local_summary)

    if rank == 0:
        rows = []
        for r in range(world_size):
            with open(f"{args.outfile}.rank{r}") as f:
                rows.extend(line.rstrip("\n").split("\t") for line in f if line.strip())
        rows.sort(key=lambda row: int(row[0]))
        with open(args.outfile, "w") as f:
            print("idx\tlabel\tpredict\tradius\tcorrect\ttime", file=f)
            for row in rows:
                print("\t".join(row), file=f)
        n = sum(s["n"] for s in gathered)
        radii = np.array(sum((s["radius_correct"] for s in gathered), []))
        print(f"certified {n} points, smoothed accuracy {sum(s['correct'] for s in gathered) / n:.4f}, "
              f"abstained {sum(s['abstain'] for s in gathered) / n:.4f}, "
              f"gpu-hours {sum(s['time'] for s in gathered) / 3600:.2f}")
        for r in [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5]:
            print(f"  certified acc @ {r:.2f}: {(radii >= r).sum() / n:.4f}")
        for r in range(world_size):
            os.remove(f"{args.outfile}.rank{r}")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
