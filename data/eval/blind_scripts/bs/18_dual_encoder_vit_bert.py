"""Dual encoder (timm ViT image tower + BERT text tower) trained with a global
InfoNCE loss for image-text retrieval on Conceptual Captions, evaluated on Flickr30k.

    torchrun --nproc_per_node=8 18_dual_encoder_vit_bert.py --config configs/dual_vitb_bert.yaml
"""
import argparse
import json
import math
import os

import timm
import torch
import torch.distributed as dist
import torch.distributed.nn
import torch.nn as nn
import torch.nn.functional as F
import yaml
from PIL import Image
from timm.data import create_transform, resolve_data_config
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer, BertModel


class JsonPairs(Dataset):
    def __init__(self, path, root, transform):
        self.items = json.load(open(path))
        self.root, self.transform = root, transform

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        return self.transform(Image.open(os.path.join(self.root, it["image"])).convert("RGB")), it["caption"], i


class DualEncoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.visual = timm.create_model(cfg["vit"], pretrained=True, num_classes=0)
        self.text = BertModel.from_pretrained(cfg["bert"])
        self.img_proj = nn.Linear(self.visual.num_features, cfg["embed_dim"], bias=False)
        self.txt_proj = nn.Linear(self.text.config.hidden_size, cfg["embed_dim"], bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def encode_image(self, images):
        return F.normalize(self.img_proj(self.visual(images)), dim=-1)

    def encode_text(self, input_ids, attention_mask):
        h = self.text(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return F.normalize(self.txt_proj(h[:, 0]), dim=-1)

    def forward(self, images, input_ids, attention_mask):
        return self.encode_image(images), self.encode_text(input_ids, attention_mask), self.logit_scale.exp()


def info_nce(img, txt, scale):
    rank = dist.get_rank()
    all_img = torch.cat(torch.distributed.nn.all_gather(img))
    all_txt = torch.cat(torch.distributed.nn.all_gather(txt))
    labels = torch.arange(img.shape[0], device=img.device) + rank * img.shape[0]
    return (F.cross_entropy(scale * img @ all_txt.T, labels) + F.cross_entropy(scale * txt @ all_img.T, labels)) / 2


@torch.no_grad()
def flickr_recall(model, loader, tokenizer, device):
    """Flickr30k test: 1000 images x 5 captions, items ordered image-major."""
    model.eval()
    net = model.module
    img_f, txt_f, idx_all = [], [], []
    for images, caps, idx in loader:
        tok = tokenizer(list(caps), padding=True, truncation=True, max_length=64, return_tensors="pt").to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            img_f.append(net.encode_image(images.to(device)).float())
            txt_f.append(net.encode_text(tok.input_ids, tok.attention_mask).float())
        idx_all.append(idx.to(device))
    local = [torch.cat(img_f), torch.cat(txt_f), torch.cat(idx_all)]
    gathered = []
    for t in local:
        buf = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(buf, t)
        gathered.append(torch.cat(buf))
    img_f, txt_f, idx = gathered
    order = idx.argsort()
    img_f, txt_f, idx = img_f[order], txt_f[order], idx[order]
    keep = torch.cat([torch.ones(1, dtype=torch.bool, device=device), idx[1:] != idx[:-1]])
    img_f, txt_f = img_f[keep][::5], txt_f[keep]
    sim = txt_f @ img_f.T
    gt = torch.arange(txt_f.shape[0], device=device) // 5
    ranks = (sim.argsort(dim=1, descending=True) == gt[:, None]).float().argmax(1)
    model.train()
    return {f"t2i_R@{k}": (ranks < k).float().mean().item() for k in (1, 5, 10)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    args = ap.parse_args()
    cfg = yaml.safe_load(open(args.config))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    model = DualEncoder(cfg).to(device)
    data_cfg = resolve_data_config({}, model=model.visual)
    train_tf = create_transform(**data_cfg, is_training=True, auto_augment=None)
    eval_tf = create_transform(**data_cfg, is_training=False)
    tokenizer = AutoTokenizer.from_pretrained(cfg["bert"])
    model = DDP(model, device_ids=[local_rank])

    train_ds = JsonPairs(cfg["train_json"], cfg["train_root"], train_tf)
    test_ds = JsonPairs(cfg["test_json"], cfg["test_root"], eval_tf)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.get("seed", 0))
    train_loader = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=sampler, drop_last=True,
                              num_workers=cfg.get("workers", 8), pin_memory=True, persistent_workers=True)
    test_loader = DataLoader(test_ds, batch_size=128, sampler=DistributedSampler(test_ds, shuffle=False),
                             num_workers=4)

    tower_lr = {"module.visual.": cfg["lr"] * cfg.get("vit_lr_mult", 0.1),
                "module.text.": cfg["lr"] * cfg.get("bert_lr_mult", 0.1)}
    groups = {}
    for n, p in model.named_parameters():
        lr = next((v for k, v in tower_lr.items() if n.startswith(k)), cfg["lr"])
        wd = 0.0 if p.ndim < 2 else cfg["wd"]
        groups.setdefault((lr, wd), []).append(p)
    optimizer = torch.optim.AdamW([{"params": ps, "lr": lr, "weight_decay": wd, "initial_lr": lr}
                                   for (lr, wd), ps in groups.items()])
    total = cfg["epochs"] * len(train_loader)
    warm = cfg.get("warmup", 1000)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))

    out_dir = cfg["output_dir"]
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
    best = 0.0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        for i, (images, caps, _) in enumerate(train_loader):
            tok = tokenizer(list(caps), padding=True, truncation=True, max_length=64, return_tensors="pt").to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                img, txt, scale = model(images.to(device, non_blocking=True), tok.input_ids, tok.attention_mask)
                loss = info_nce(img.float(), txt.float(), scale)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            sched.step()
            with torch.no_grad():
                model.module.logit_scale.clamp_(0, math.log(100))
            if i % 100 == 0:
                lv = loss.detach()
                dist.all_reduce(lv, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} it {i}/{len(train_loader)} loss {lv.item():.4f} "
                          f"T {1 / scale.item():.4f}", flush=True)

        rec = flickr_recall(model, test_loader, tokenizer, device)
        if rank == 0:
            print(f"epoch {epoch} flickr30k " + " ".join(f"{k}={v * 100:.1f}" for k, v in rec.items()))
            state = {"model": model.module.state_dict(), "epoch": epoch, "cfg": cfg, "recall": rec}
            torch.save(state, os.path.join(out_dir, "last.pt"))
            if rec["t2i_R@1"] > best:
                best = rec["t2i_R@1"]
                torch.save(state, os.path.join(out_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
