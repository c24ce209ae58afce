"""Shared-backbone multi-task model: defect type (task "defect") and part
family (task "family") from line-scan camera crops.

Kubeflow PyTorchJob, Master x1 + Worker x2, each pod asks for 8 GPUs. The
operator gives every pod MASTER_ADDR, MASTER_PORT, WORLD_SIZE (number of pods)
and RANK (pod index); we fork one worker per GPU inside the pod.

    containers:
      - name: pytorch
        command: ["python", "-u", "/workspace/train_multitask.py"]
        args: ["--defect-root", "/datasets/defects", "--family-root", "/datasets/families",
               "--out", "/checkpoints/mt-r50", "--epochs", "40"]
"""
import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder
from torchvision.models import resnet50, ResNet50_Weights


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--defect-root", required=True)
    p.add_argument("--family-root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=48)
    p.add_argument("--lr", type=float, default=0.1, help="at global batch 256")
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args()


class MultiTaskNet(nn.Module):
    def __init__(self, n_defect, n_family):
        super().__init__()
        backbone = resnet50(weights=ResNet50_Weights.IMAGENET1K_V2)
        backbone.fc = nn.Identity()
        self.backbone = backbone
        self.heads = nn.ModuleDict({
            "defect": nn.Sequential(nn.Dropout(0.2), nn.Linear(2048, n_defect)),
            "family": nn.Linear(2048, n_family),
        })

    def forward(self, x, task):
        return self.heads[task](self.backbone(x))


def transforms():
    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train = T.Compose([T.RandomResizedCrop(224, scale=(0.5, 1.0)), T.RandomHorizontalFlip(),
                       T.RandomVerticalFlip(), T.ColorJitter(0.2, 0.2), T.ToTensor(), norm])
    val = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm])
    return train, val


@torch.no_grad()
def evaluate(net, loaders, device):
    net.eval()
    res = {}
    for task, loader in loaders.items():
        t = torch.zeros(2, device=device, dtype=torch.float64)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            t[0] += (net(x, task).argmax(1) == y).sum()
            t[1] += y.numel()
        dist.all_reduce(t)
        res[task] = (t[0] / t[1]).item()
    net.train()
    return res


def worker(gpu, ngpus_per_pod, args):
    pod_rank = int(os.environ["RANK"])
    n_pods = int(os.environ["WORLD_SIZE"])
    rank = pod_rank * ngpus_per_pod + gpu
    world_size = n_pods * ngpus_per_pod

    torch.cuda.set_device(gpu)
    device = torch.device("cuda", gpu)
    dist.init_process_group("nccl", init_method="env://", world_size=world_size, rank=rank,
                            timeout=datetime.timedelta(minutes=20))

    tr_tf, va_tf = transforms()
    train = {"defect": ImageFolder(os.path.join(args.defect_root, "train"), tr_tf),
             "family": ImageFolder(os.path.join(args.family_root, "train"), tr_tf)}
    val = {"defect": ImageFolder(os.path.join(args.defect_root, "val"), va_tf),
           "family": ImageFolder(os.path.join(args.family_root, "val"), va_tf)}
    samplers = {k: DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
                for k, ds in train.items()}
    train_dl = {k: DataLoader(train[k], batch_size=args.batch_size, sampler=samplers[k],
                              num_workers=args.workers, pin_memory=True, drop_last=True)
                for k in train}
    val_dl = {k: DataLoader(Subset(ds, range(rank, len(ds), world_size)), batch_size=128,
                            num_workers=args.workers, pin_memory=True)
              for k, ds in val.items()}

    model = MultiTaskNet(len(train["defect"].classes), len(train["family"].classes))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    # each step trains one head only, the other head has no grad that step
    model = DDP(model, device_ids=[gpu], find_unused_parameters=True)

    lr = args.lr * args.batch_size * world_size / 256
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4, nesterov=True)
    steps_per_epoch = 2 * min(len(d) for d in train_dl.values())
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, epochs=args.epochs,
                                                steps_per_epoch=steps_per_epoch, pct_start=0.05)

    os.makedirs(args.out, exist_ok=True)
    ckpt = os.path.join(args.out, "last.pt")
    start = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt, map_location={"cuda:0": f"cuda:{gpu}"})
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start = state["epoch"] + 1

    for epoch in range(start, args.epochs):
        for s in samplers.values():
            s.set_epoch(epoch)
        t0 = time.time()
        it_d, it_f = iter(train_dl["defect"]), iter(train_dl["family"])
        for step in range(steps_per_epoch):
            task = "defect" if step % 2 == 0 else "family"
            x, y = next(it_d) if task == "defect" else next(it_f)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x, task), y, label_smoothing=0.05)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} {step}/{steps_per_epoch} {task} loss {loss.item():.3f}", flush=True)

        accs = evaluate(model.module, val_dl, device)
        if rank == 0:
            print(f"ep {epoch} {time.time() - t0:.0f}s val {accs}", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "val": accs}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    args = cli()
    n = torch.cuda.device_count()
    mp.spawn(worker, args=(n, args), nprocs=n, join=True)
