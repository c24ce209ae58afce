"""Dual-encoder contrastive pretraining: timm ViT image tower + BERT text tower.

Data: webdataset shards with jpg/txt pairs (LAION-400M subset).
Run:  torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $HEAD:29500 \
          03_timm_bert_dual_encoder.py --config configs/vit_bert.yaml
"""
import argparse
import math
import os
import time

import braceexpand
import timm
import torch
import torch.distributed as dist
import torch.distributed.nn
import torch.nn as nn
import torch.nn.functional as F
import webdataset as wds
import yaml
from timm.data import create_transform, resolve_data_config
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoModel, AutoTokenizer


DEFAULTS = dict(
    image_model="vit_base_patch16_224",
    text_model="bert-base-uncased",
    embed_dim=512,
    context_length=64,
    train_shards="/datasets/laion400m/{00000..04095}.tar",
    samples_per_epoch=40_000_000,
    batch_size=224,
    epochs=10,
    lr=3e-4,
    text_lr=5e-5,
    weight_decay=0.1,
    warmup_steps=5000,
    workers=10,
    out_dir="/checkpoints/vit_bert",
    save_every=2000,
)


class DualEncoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.visual = timm.create_model(cfg["image_model"], pretrained=True, num_classes=0)
        self.text = AutoModel.from_pretrained(cfg["text_model"])
        self.image_proj = nn.Linear(self.visual.num_features, cfg["embed_dim"], bias=False)
        self.text_proj = nn.Linear(self.text.config.hidden_size, cfg["embed_dim"], bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def encode_image(self, images):
        return F.normalize(self.image_proj(self.visual(images)), dim=-1)

    def encode_text(self, input_ids, attention_mask):
        out = self.text(input_ids=input_ids, attention_mask=attention_mask)
        cls = out.last_hidden_state[:, 0]
        return F.normalize(self.text_proj(cls), dim=-1)

    def forward(self, images, input_ids, attention_mask):
        return self.encode_image(images), self.encode_text(input_ids, attention_mask), self.logit_scale.exp()


def contrastive_loss(img, txt, scale):
    # all_gather from torch.distributed.nn keeps the gradient for every rank's slice
    all_img = torch.cat(torch.distributed.nn.all_gather(img))
    all_txt = torch.cat(torch.distributed.nn.all_gather(txt))
    logits = scale * all_img @ all_txt.t()
    labels = torch.arange(logits.size(0), device=logits.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def build_loader(cfg, transform, tokenizer, world_size):
    urls = list(braceexpand.braceexpand(cfg["train_shards"]))

    def collate(batch):
        images, captions = zip(*batch)
        tok = tokenizer(list(captions), padding="max_length", truncation=True,
                        max_length=cfg["context_length"], return_tensors="pt")
        return torch.stack(images), tok["input_ids"], tok["attention_mask"]

    ds = wds.DataPipeline(
        wds.ResampledShards(urls),
        wds.tarfile_to_samples(handler=wds.warn_and_continue),
        wds.shuffle(10000, initial=2000),
        wds.decode("pil", handler=wds.warn_and_continue),
        wds.to_tuple("jpg;png;webp", "txt", handler=wds.warn_and_continue),
        wds.map_tuple(transform, lambda s: s.strip()),
        wds.batched(cfg["batch_size"], collation_fn=collate, partial=False),
    )
    global_batch = cfg["batch_size"] * world_size
    steps = math.ceil(cfg["samples_per_epoch"] / global_batch)
    ds = ds.with_epoch(math.ceil(steps / max(1, cfg["workers"])))
    loader = wds.WebLoader(ds, batch_size=None, num_workers=cfg["workers"], persistent_workers=True)
    return loader, steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--resume", default=None)
    cli = ap.parse_args()
    cfg = dict(DEFAULTS)
    if cli.config:
        with open(cli.config) as f:
            cfg.update(yaml.safe_load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    main_proc = rank == 0
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    model = DualEncoder(cfg).to(device)
    data_cfg = resolve_data_config({}, model=model.visual)
    transform = create_transform(**data_cfg, is_training=True)
    tokenizer = AutoTokenizer.from_pretrained(cfg["text_model"])

    model = DDP(model, device_ids=[local_rank])

    text_params = [p for n, p in model.module.named_parameters() if n.startswith("text.")]
    other_params = [p for n, p in model.module.named_parameters() if not n.startswith("text.")]
    optimizer = torch.optim.AdamW([
        {"params": text_params, "lr": cfg["text_lr"], "base_lr": cfg["text_lr"]},
        {"params": other_params, "lr": cfg["lr"], "base_lr": cfg["lr"]},
    ], weight_decay=cfg["weight_decay"], betas=(0.9, 0.98), eps=1e-6)

    loader, steps_per_epoch = build_loader(cfg, transform, tokenizer, world)
    total = steps_per_epoch * cfg["epochs"]

    def set_lr(step):
        for g in optimizer.param_groups:
            if step < cfg["warmup_steps"]:
                g["lr"] = g["base_lr"] * (step + 1) / cfg["warmup_steps"]
            else:
                t = (step - cfg["warmup_steps"]) / max(1, total - cfg["warmup_steps"])
                g["lr"] = g["base_lr"] * 0.5 * (1 + math.cos(math.pi * t))

    step = 0
    if cli.resume:
        sd = torch.load(cli.resume, map_location="cpu")
        model.module.load_state_dict(sd["model"])
        optimizer.load_state_dict(sd["optimizer"])
        step = sd["step"]

    if main_proc:
        os.makedirs(cfg["out_dir"], exist_ok=True)
        print(f"world={world} global_batch={cfg['batch_size'] * world} steps/epoch={steps_per_epoch}")

    model.train()
    start_epoch = step // steps_per_epoch
    for epoch in range(start_epoch, cfg["epochs"]):
        tic = time.time()
        for images, input_ids, attn in loader:
            set_lr(step)
            images = images.to(device, non_blocking=True)
            input_ids = input_ids.to(device, non_blocking=True)
            attn = attn.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                img, txt, scale = model(images, input_ids, attn)
                loss = contrastive_loss(img.float(), txt.float(), scale)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            with torch.no_grad():
                model.module.logit_scale.clamp_(0, math.log(100))
            step += 1

            if main_proc and step % 100 == 0:
                print(f"ep {epoch} step {step}/{total} loss {loss.item():.4f} "
                      f"T {1 / scale.item():.4f} {(time.time() - tic) / 100:.3f}s/it", flush=True)
                tic = time.time()
            if main_proc and step % cfg["save_every"] == 0:
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "step": step, "cfg": cfg}, os.path.join(cfg["out_dir"], "last.pt"))

    if main_proc:
        torch.save({"model": model.module.state_dict(), "step": step, "cfg": cfg},
                   os.path.join(cfg["out_dir"], "final.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
