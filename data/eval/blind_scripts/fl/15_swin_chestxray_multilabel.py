"""Swin-B multi-label classifier for NIH ChestX-ray14 with DeepSpeed ZeRO-2 (fp16).

After training, rank 0 reloads the exported best weights into a plain fp32 model and
scores the held-out test list (the exported file is what the inference service loads).

    deepspeed --num_gpus 8 15_swin_chestxray_multilabel.py --root /data/cxr14 --out runs/swin_cxr14
"""
import argparse
import os

import deepspeed
import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from sklearn.metrics import roc_auc_score
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

FINDINGS = ["Atelectasis", "Cardiomegaly", "Effusion", "Infiltration", "Mass", "Nodule", "Pneumonia",
            "Pneumothorax", "Consolidation", "Edema", "Emphysema", "Fibrosis", "Pleural_Thickening", "Hernia"]


class CXR14(Dataset):
    def __init__(self, root, list_file, transform):
        meta = pd.read_csv(os.path.join(root, "Data_Entry_2017.csv")).set_index("Image Index")
        with open(os.path.join(root, list_file)) as f:
            names = [l.strip() for l in f if l.strip()]
        self.paths = [os.path.join(root, "images", n) for n in names]
        labels = meta.loc[names, "Finding Labels"].str.split("|")
        self.targets = np.array([[float(f in ls) for f in FINDINGS] for ls in labels], dtype=np.float32)
        self.transform = transform

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = Image.open(self.paths[i]).convert("RGB")
        return self.transform(img), self.targets[i]


def build_model(pretrained=True):
    return timm.create_model("swin_base_patch4_window7_224", pretrained=pretrained,
                             num_classes=len(FINDINGS), drop_path_rate=0.2)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", default="runs/swin_cxr14")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--local_rank", type=int, default=-1)
    return p.parse_args()


def mean_auc(targets, probs):
    aucs = [roc_auc_score(targets[:, k], probs[:, k]) for k in range(targets.shape[1])
            if 0 < targets[:, k].sum() < len(targets)]
    return float(np.mean(aucs))


@torch.no_grad()
def predict_distributed(engine, loader):
    engine.eval()
    probs, tgts = [], []
    for x, y in loader:
        probs.append(torch.sigmoid(engine(x.to(engine.device).half()).float()))
        tgts.append(y.to(engine.device))
    probs, tgts = torch.cat(probs), torch.cat(tgts)
    ws = dist.get_world_size()
    out_p = [torch.zeros_like(probs) for _ in range(ws)]
    out_t = [torch.zeros_like(tgts) for _ in range(ws)]
    dist.all_gather(out_p, probs)
    dist.all_gather(out_t, tgts)
    engine.train()
    return torch.cat(out_t).cpu().numpy(), torch.cat(out_p).cpu().numpy()


@torch.no_grad()
def test_exported(path, loader, device):
    model = build_model(pretrained=False)
    model.load_state_dict(torch.load(path, map_location="cpu"))
    model.to(device).eval()
    probs, tgts = [], []
    for x, y in loader:
        probs.append(torch.sigmoid(model(x.to(device))).cpu())
        tgts.append(y)
    return mean_auc(torch.cat(tgts).numpy(), torch.cat(probs).numpy())


def main():
    args = get_args()
    deepspeed.init_distributed()
    rank = dist.get_rank()
    normalize = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.RandomResizedCrop(224, scale=(0.7, 1.0)),
                                   transforms.RandomHorizontalFlip(), transforms.RandomRotation(7),
                                   transforms.ToTensor(), normalize])
    eval_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224),
                                  transforms.ToTensor(), normalize])

    train_set = CXR14(args.root, "train_list.txt", train_tf)
    val_set = CXR14(args.root, "val_list.txt", eval_tf)
    test_set = CXR14(args.root, "test_list.txt", eval_tf)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=64, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=8)

    pos_frac = train_set.targets.mean(0)
    pos_weight = torch.tensor((1 - pos_frac) / np.clip(pos_frac, 1e-3, None)).clamp(max=20.0)

    model = build_model()
    steps = len(train_loader) * args.epochs
    config = {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.05}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": steps,
                                                           "warmup_num_steps": steps // 20}},
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True},
        "gradient_clipping": 5.0,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    criterion = nn.BCEWithLogitsLoss(pos_weight=pos_weight.to(engine.device))
    os.makedirs(args.out, exist_ok=True)
    best_path = os.path.join(args.out, "swin_cxr14_best.pt")

    best_auc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for step, (x, y) in enumerate(train_loader):
            x = x.to(engine.device, non_blocking=True).half()
            y = y.to(engine.device, non_blocking=True)
            loss = criterion(engine(x).float(), y)
            engine.backward(loss)
            engine.step()
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step}/{len(train_loader)} bce {loss.item():.4f}", flush=True)

        targets, probs = predict_distributed(engine, val_loader)
        engine.save_checkpoint(args.out, tag=f"epoch{epoch}", client_state={"epoch": epoch})
        if rank == 0:
            auc = mean_auc(targets, probs)
            print(f"epoch {epoch}: val mean AUROC {auc:.4f}", flush=True)
            if auc > best_auc:
                best_auc = auc
                sd = {k: v.float().cpu() for k, v in engine.state_dict().items()}
                torch.save(sd, best_path)

    dist.barrier()
    if rank == 0:
        test_loader = DataLoader(test_set, batch_size=128, num_workers=8)
        test_auc = test_exported(best_path, test_loader, engine.device)
        print(f"best val AUROC {best_auc:.4f}  test AUROC {test_auc:.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
