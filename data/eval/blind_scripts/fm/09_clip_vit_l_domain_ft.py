"""Domain adaptation of CLIP ViT-L/14 on medical image-report pairs.

Vision tower is fine-tuned, text tower is frozen (locked-text tuning). FSDP
shards the whole CLIPModel; contrastive loss uses negatives gathered from all
ranks.

    torchrun --nproc_per_node=8 09_clip_vit_l_domain_ft.py --train-csv data/train.csv --val-csv data/val.csv
"""
import argparse
import functools
import logging
import math
import os

import pandas as pd
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import CLIPModel, CLIPProcessor
from transformers.models.clip.modeling_clip import CLIPEncoderLayer

log = logging.getLogger(__name__)


class PairCSV(Dataset):
    def __init__(self, csv_path, processor, image_root):
        self.df = pd.read_csv(csv_path)
        self.processor = processor
        self.image_root = image_root

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        row = self.df.iloc[i]
        img = Image.open(os.path.join(self.image_root, row["path"])).convert("RGB")
        pix = self.processor(images=img, return_tensors="pt")["pixel_values"][0]
        txt = self.processor.tokenizer(row["report"], padding="max_length", max_length=77,
                                       truncation=True, return_tensors="pt")
        return pix, txt["input_ids"][0], txt["attention_mask"][0]


class CLIPForContrastive(nn.Module):
    """Returns normalised embeddings and the temperature from inside forward."""

    def __init__(self, clip):
        super().__init__()
        self.clip = clip

    def forward(self, pixel_values, input_ids, attention_mask):
        img = self.clip.get_image_features(pixel_values=pixel_values)
        txt = self.clip.get_text_features(input_ids=input_ids, attention_mask=attention_mask)
        scale = self.clip.logit_scale.exp().clamp(max=100)
        return F.normalize(img.float(), dim=-1), F.normalize(txt.float(), dim=-1), scale.float()


def clip_loss(img_emb, txt_emb, logit_scale, rank):
    all_img = torch.cat(dist_nn.all_gather(img_emb), dim=0)
    all_txt = torch.cat(dist_nn.all_gather(txt_emb), dim=0)
    logits_i = logit_scale * img_emb @ all_txt.t()
    logits_t = logit_scale * txt_emb @ all_img.t()
    n = img_emb.shape[0]
    labels = torch.arange(n, device=img_emb.device) + rank * n
    return 0.5 * (F.cross_entropy(logits_i, labels) + F.cross_entropy(logits_t, labels))


@torch.no_grad()
def retrieval_eval(model, loader, device):
    model.eval()
    img_embs, txt_embs = [], []
    for pix, ids, mask in loader:
        img, txt, _ = model(pix.to(device), ids.to(device), mask.to(device))
        img_embs.append(img)
        txt_embs.append(txt)
    img = torch.cat(img_embs)
    txt = torch.cat(txt_embs)
    sims = img @ txt.t()
    gt = torch.arange(len(img), device=device)
    metrics = {}
    for k in (1, 5, 10):
        topk_i2t = sims.topk(k, dim=1).indices
        topk_t2i = sims.t().topk(k, dim=1).indices
        metrics[f"i2t_R@{k}"] = (topk_i2t == gt[:, None]).any(1).float().mean().item()
        metrics[f"t2i_R@{k}"] = (topk_t2i == gt[:, None]).any(1).float().mean().item()
    model.train()
    return metrics


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="openai/clip-vit-large-patch14")
    ap.add_argument("--train-csv", required=True)
    ap.add_argument("--val-csv", required=True)
    ap.add_argument("--image-root", default="/data/mimic-cxr-jpg")
    ap.add_argument("--out", default="ckpt/clip-med")
    ap.add_argument("--bs", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--warmup-steps", type=int, default=500)
    args = ap.parse_args()

    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"[rank{rank}] %(asctime)s %(message)s")

    processor = CLIPProcessor.from_pretrained(args.model)
    clip = CLIPModel.from_pretrained(args.model)
    clip.text_model.requires_grad_(False)
    clip.text_projection.requires_grad_(False)
    model = CLIPForContrastive(clip)

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={CLIPEncoderLayer})
    model = FSDP(model, auto_wrap_policy=policy, device_id=device, use_orig_params=True,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                buffer_dtype=torch.bfloat16))

    train_ds = PairCSV(args.train_csv, processor, args.image_root)
    val_ds = PairCSV(args.val_csv, processor, args.image_root)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=10,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=256, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=8, pin_memory=True)

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "logit_scale" in n else decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.98))
    total = args.epochs * len(train_loader)

    def lr_lambda(s):
        if s < args.warmup_steps:
            return (s + 1) / args.warmup_steps
        return 0.5 * (1 + math.cos(math.pi * (s - args.warmup_steps) / max(1, total - args.warmup_steps)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)

    best_r1 = 0.0
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for pix, ids, mask in train_loader:
            pix, ids, mask = pix.to(device, non_blocking=True), ids.to(device), mask.to(device)
            img, txt, scale = model(pix, ids, mask)
            loss = clip_loss(img, txt, scale, rank)
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 50 == 0:
                log.info("epoch %d step %d loss %.4f lr %.2e", epoch, step, loss.item(), scheduler.get_last_lr()[0])

        metrics = retrieval_eval(model, val_loader, device)
        r1 = 0.5 * (metrics["i2t_R@1"] + metrics["t2i_R@1"])
        if rank == 0:
            log.info("epoch %d val %s", epoch, " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))

        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
            sd = model.state_dict()
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save(sd, os.path.join(args.out, "last.pt"))
            if r1 > best_r1:
                best_r1 = r1
                torch.save(sd, os.path.join(args.out, "best.pt"))
                log.info("new best R@1 %.4f", r1)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
