"""QAT fine-tuning of DS-CNN-S for the int8 micro-controller build.

The float model comes from our DDP float recipe (saved as the raw DDP state
dict, so the keys still carry the "module." prefix).  Eager-mode QAT with the
fbgemm/qnnpack fake-quant; observers and BN stats are frozen in the last
epochs; rank 0 converts and exports the int8 model at the end.

    torchrun --nproc_per_node=4 09_dscnn_qat_finetune.py --float-weights exp/dscnn_s/model_final.pt \
        --feat-dir /data/gsc_mfcc_49x10 --out-dir exp/dscnn_s_qat
"""
import argparse
import copy
import os
import time

import numpy as np
import torch
import torch.ao.nn.intrinsic.qat as nniqat
import torch.ao.quantization as tq
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def conv_bn_relu(cin, cout, k, stride=1, groups=1, padding=0):
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride, padding, groups=groups, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU())


class DSCNNS(nn.Module):
    def __init__(self, n_classes=12, ch=64):
        super().__init__()
        self.quant = tq.QuantStub()
        layers = [conv_bn_relu(1, ch, (10, 4), stride=(2, 2), padding=(5, 1))]
        for _ in range(4):
            layers += [conv_bn_relu(ch, ch, 3, padding=1, groups=ch), conv_bn_relu(ch, ch, 1)]
        self.body = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(ch, n_classes)
        self.dequant = tq.DeQuantStub()

    def forward(self, x):
        x = self.body(self.quant(x))
        return self.dequant(self.fc(self.pool(x).flatten(1)))

    def fuse(self):
        for block in self.body:
            tq.fuse_modules_qat(block, ["0", "1", "2"], inplace=True)


def load_split(feat_dir, split):
    x = torch.from_numpy(np.load(os.path.join(feat_dir, f"{split}_mfcc.npy"))).float().unsqueeze(1)
    y = torch.from_numpy(np.load(os.path.join(feat_dir, f"{split}_labels.npy"))).long()
    return TensorDataset(x, y)


@torch.no_grad()
def accuracy(model, loader, device):
    model.eval()
    acc = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        acc[0] += (model(x).argmax(1) == y).sum()
        acc[1] += y.numel()
    dist.all_reduce(acc)
    return (acc[0] / acc[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--float-weights", required=True)
    ap.add_argument("--feat-dir", required=True)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--bs", type=int, default=100)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--backend", default="qnnpack", choices=["qnnpack", "fbgemm"])
    args = ap.parse_args()

    dist.init_process_group(backend="nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1)

    train_set = load_split(args.feat_dir, "train")
    val_set = load_split(args.feat_dir, "val")
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.bs, sampler=sampler, num_workers=2, pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), 500, num_workers=2)

    model = DSCNNS()
    state = torch.load(args.float_weights, map_location="cpu")
    consume_prefix_in_state_dict_if_present(state, "module.")
    model.load_state_dict(state)
    model.train()
    model.fuse()
    model.qconfig = tq.get_default_qat_qconfig(args.backend)
    tq.prepare_qat(model, inplace=True)
    model.to(device)
    ddp = DDP(model, device_ids=[local_rank])

    opt = torch.optim.Adam(ddp.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs * len(train_loader))
    freeze_obs_at, freeze_bn_at = args.epochs - 3, args.epochs - 2

    best, best_state = 0.0, None
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        if epoch >= freeze_obs_at:
            ddp.apply(tq.disable_observer)
        if epoch >= freeze_bn_at:
            ddp.apply(nniqat.freeze_bn_stats)
        t0 = time.time()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(ddp(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        acc = accuracy(ddp.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} fake-quant acc {acc:.4f} loss {loss.item():.4f} {time.time() - t0:.0f}s", flush=True)
        if acc > best:
            best = acc
            best_state = copy.deepcopy(ddp.module.state_dict())

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        torch.save(best_state, os.path.join(args.out_dir, "qat_best.pt"))
        torch.backends.quantized.engine = args.backend
        export = copy.deepcopy(ddp.module).cpu()
        export.load_state_dict({k: v.cpu() for k, v in best_state.items()})
        export.eval()
        int8 = tq.convert(export, inplace=False)
        example = torch.randn(1, 1, 49, 10)
        traced = torch.jit.trace(int8, example)
        traced.save(os.path.join(args.out_dir, "dscnn_s_int8.pt"))
        print(f"exported int8 model, best fake-quant acc {best:.4f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
