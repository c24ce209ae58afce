"""Class-balanced self-training (CBST, Zou et al. ECCV'18) for Office-Home, DDP.

Starting from a source-only checkpoint, alternate
  1. label the whole target domain with the current model,
  2. pick per-class confidence thresholds so that the top p% of every class is kept,
  3. fine-tune on source + selected pseudo-labelled target,
growing p after every round.

    torchrun --nproc_per_node=4 04_cbst_selftrain.py --root data/office-home \
        --source Art --target Clipart --init runs/src_only_Art/best.pth
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms

NUM_CLASSES = 65
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


class ImageList(Dataset):
    def __init__(self, root, list_file, transform, labels=None, indices=None):
        with open(list_file) as f:
            items = [(l.split()[0], int(l.split()[1])) for l in f if l.strip()]
        if indices is not None:
            items = [(items[i][0], int(labels[k])) for k, i in enumerate(indices)]
        self.root, self.items, self.transform = root, items, transform

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        p, y = self.items[i]
        return self.transform(Image.open(os.path.join(self.root, p)).convert("RGB")), y, i


def build_model():
    net = models.resnet50(weights=None)
    net.fc = nn.Linear(net.fc.in_features, NUM_CLASSES)
    return net


def concat_all_gather(t):
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.cat(out)


@torch.no_grad()
def predict_target(model, loader, device):
    model.eval()
    confs, preds, idxs, labels = [], [], [], []
    for x, y, idx in loader:
        prob = model(x.to(device, non_blocking=True)).softmax(1)
        c, p = prob.max(1)
        confs.append(c); preds.append(p)
        idxs.append(idx.to(device)); labels.append(y.to(device))
    model.train()
    return torch.cat(confs), torch.cat(preds), torch.cat(idxs), torch.cat(labels)


def class_thresholds(conf, pred, portion):
    thr = torch.ones(NUM_CLASSES, device=conf.device)
    for c in range(NUM_CLASSES):
        conf_c = concat_all_gather(conf[pred == c])
        if conf_c.numel() == 0:
            continue
        k = max(int(round(conf_c.numel() * portion)), 1)
        thr[c] = conf_c.sort(descending=True).values[k - 1]
    return thr


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="data/office-home")
    ap.add_argument("--source", default="Art")
    ap.add_argument("--target", default="Clipart")
    ap.add_argument("--init", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--init-portion", type=float, default=0.2)
    ap.add_argument("--portion-step", type=float, default=0.1)
    ap.add_argument("--max-portion", type=float, default=0.6)
    ap.add_argument("--epochs-per-round", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2.5e-4)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--out", default="runs/cbst")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    test_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224),
                                  transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    lists = os.path.join(args.root, "image_list")
    src_list = os.path.join(lists, f"{args.source}.txt")
    tgt_list = os.path.join(lists, f"{args.target}.txt")
    source = ImageList(args.root, src_list, train_tf)
    target_eval = ImageList(args.root, tgt_list, test_tf)
    eval_sampler = DistributedSampler(target_eval, shuffle=False)
    eval_loader = DataLoader(target_eval, batch_size=64, sampler=eval_sampler,
                             num_workers=args.workers, pin_memory=True)

    model = build_model()
    state = torch.load(args.init, map_location="cpu")
    model.load_state_dict(state["model"])
    model = DDP(model.to(device), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    portion = args.init_portion
    for rnd in range(args.rounds):
        t0 = time.time()
        conf, pred, idx, gt = predict_target(model, eval_loader, device)

        # accuracy of the current model on the target (labels only used for reporting)
        stats = torch.tensor([(pred == gt).sum().item(), gt.numel()], device=device, dtype=torch.float)
        dist.all_reduce(stats)

        thr = class_thresholds(conf, pred, portion)
        keep = conf >= thr[pred]

        # every rank assembles the same global pseudo-label table
        all_idx = concat_all_gather(idx)
        all_pred = concat_all_gather(pred)
        all_keep = concat_all_gather(keep.to(torch.uint8)).bool()
        all_gt = concat_all_gather(gt)
        table = {}
        for i, p, k, g in zip(all_idx.tolist(), all_pred.tolist(), all_keep.tolist(), all_gt.tolist()):
            if k:
                table[i] = (p, g)
        sel = sorted(table)
        pl = np.array([table[i][0] for i in sel])
        pl_acc = float(np.mean([table[i][0] == table[i][1] for i in sel])) if sel else 0.0
        if rank == 0:
            print(f"round {rnd}: target acc {100 * stats[0] / stats[1]:.2f} | portion {portion:.2f} "
                  f"| selected {len(sel)} ({100 * pl_acc:.1f}% correct)", flush=True)

        pseudo = ImageList(args.root, tgt_list, train_tf, labels=pl, indices=sel)
        train_set = ConcatDataset([source, pseudo])
        sampler = DistributedSampler(train_set, shuffle=True, seed=rnd)
        loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                            num_workers=args.workers, pin_memory=True, drop_last=True)

        model.train()
        for ep in range(args.epochs_per_round):
            sampler.set_epoch(ep)
            running = torch.zeros(2, device=device)
            for x, y, _ in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss = F.cross_entropy(model(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                running += torch.stack([loss.detach() * y.numel(), torch.tensor(float(y.numel()), device=device)])
            dist.all_reduce(running)
            if rank == 0:
                print(f"  round {rnd} ep {ep}: loss {running[0] / running[1]:.4f} "
                      f"({time.time() - t0:.0f}s)", flush=True)

        if rank == 0:
            torch.save({"round": rnd, "portion": portion, "model": model.module.state_dict()},
                       os.path.join(args.out, f"round{rnd}.pth"))
        portion = min(portion + args.portion_step, args.max_portion)
        dist.barrier()

    conf, pred, idx, gt = predict_target(model, eval_loader, device)
    stats = torch.tensor([(pred == gt).sum().item(), gt.numel()], device=device, dtype=torch.float)
    dist.all_reduce(stats)
    if rank == 0:
        print(f"final target acc {100 * stats[0] / stats[1]:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
