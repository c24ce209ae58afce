"""
KD training + ONNX export in one job, for the nightly edge-model pipeline.

    teacher : ConvNeXt-Tiny fine-tuned on the retail-shelf SKU set (frozen)
    student : RegNetX-400MF
After the last epoch rank 0 reloads the best checkpoint into a fresh student,
exports ONNX (opset 17, static 1x3x224x224) and checks it with onnxruntime.

    torchrun --nproc_per_node=8 17_kd_train_and_export.py --cfg configs/sku_regnetx400.yaml
"""
import argparse
import os
import time

import numpy as np
import onnxruntime as ort
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms

CFG = {
    "data_root": "/data/sku/v7",
    "teacher_ckpt": "weights/convnext_tiny_sku_v7.pth",
    "num_classes": 1388,
    "epochs": 80,
    "batch_size": 128,
    "lr": 0.4,            # global batch 1024
    "wd": 5e-5,
    "T": 2.0,
    "kd_weight": 0.7,
    "workers": 10,
    "out_dir": "nightly/regnetx400_kd",
}


def build_student(num_classes):
    m = models.regnet_x_400mf(weights="IMAGENET1K_V2")
    m.fc = torch.nn.Linear(m.fc.in_features, num_classes)
    return m


def build_teacher(num_classes, ckpt):
    m = models.convnext_tiny()
    m.classifier[2] = torch.nn.Linear(m.classifier[2].in_features, num_classes)
    m.load_state_dict(torch.load(ckpt, map_location="cpu"))
    return m


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            pred = model(x).argmax(1)
        s[0] += (pred == y).sum()
        s[1] += y.numel()
    dist.all_reduce(s)
    return 100.0 * (s[0] / s[1]).item()


def export_onnx(cfg, ckpt_path):
    model = build_student(cfg["num_classes"])
    model.load_state_dict(torch.load(ckpt_path, map_location="cpu"))
    model.eval()
    dummy = torch.randn(1, 3, 224, 224)
    onnx_path = os.path.join(cfg["out_dir"], "student.onnx")
    torch.onnx.export(model, dummy, onnx_path, opset_version=17,
                      input_names=["image"], output_names=["logits"], do_constant_folding=True)
    sess = ort.InferenceSession(onnx_path, providers=["CPUExecutionProvider"])
    ref = model(dummy).detach().numpy()
    out = sess.run(None, {"image": dummy.numpy()})[0]
    err = np.abs(ref - out).max()
    print(f"exported {onnx_path}, max abs diff vs torch {err:.2e}", flush=True)
    assert err < 1e-3, "ONNX output diverges from PyTorch"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    ap.add_argument("--skip-export", action="store_true")
    args = ap.parse_args()
    cfg = dict(CFG)
    if args.cfg:
        with open(args.cfg) as f:
            cfg.update(yaml.safe_load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_ds = datasets.ImageFolder(os.path.join(cfg["data_root"], "train"), transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.25, 1.0)), transforms.RandomHorizontalFlip(),
        transforms.TrivialAugmentWide(), transforms.ToTensor(), norm]))
    val_ds = datasets.ImageFolder(os.path.join(cfg["data_root"], "val"), transforms.Compose([
        transforms.Resize(232), transforms.CenterCrop(224), transforms.ToTensor(), norm]))
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=256,
                            num_workers=cfg["workers"], pin_memory=True)

    teacher = build_teacher(cfg["num_classes"], cfg["teacher_ckpt"]).to(device).eval()
    teacher.requires_grad_(False)
    student = build_student(cfg["num_classes"]).to(device)
    student = DDP(student, device_ids=[local_rank])

    lr = cfg["lr"] * cfg["batch_size"] * world / 1024
    opt = torch.optim.SGD(student.parameters(), lr=lr, momentum=0.9, weight_decay=cfg["wd"], nesterov=True)
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=5 * len(train_loader))
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=(cfg["epochs"] - 5) * len(train_loader))
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warmup, cosine], milestones=[5 * len(train_loader)])
    scaler = torch.cuda.amp.GradScaler()

    best_path = os.path.join(cfg["out_dir"], "best.pth")
    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)

    best = 0.0
    T = cfg["T"]
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        student.train()
        tic = time.time()
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                with torch.no_grad():
                    t_logits = teacher(x)
                s_logits = student(x)
            s_logits, t_logits = s_logits.float(), t_logits.float()
            kd = F.kl_div(F.log_softmax(s_logits / T, 1), F.softmax(t_logits / T, 1),
                          reduction="batchmean") * T * T
            loss = cfg["kd_weight"] * kd + (1 - cfg["kd_weight"]) * F.cross_entropy(s_logits, y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            if rank == 0 and i % 100 == 0:
                print(f"[{epoch}/{cfg['epochs']}] {i}/{len(train_loader)} loss {loss.item():.4f}", flush=True)

        acc = evaluate(student.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: top1 {acc:.2f} ({time.time() - tic:.0f}s)", flush=True)
            if acc > best:
                best = acc
                torch.save(student.state_dict(), best_path)
        dist.barrier()

    if rank == 0 and not args.skip_export:
        print(f"best top1 {best:.2f}; exporting", flush=True)
        export_onnx(cfg, best_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
