"""Long-document classification (legal / patent corpora) with a from-scratch encoder,
4k-token inputs, activation checkpointing per layer.

    torchrun --nproc_per_node=8 20_long_doc_encoder.py data=patents model.max_len=4096 model.pool=mean
"""
import logging
import math
import os

import hydra
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate, to_absolute_path
from omegaconf import DictConfig, OmegaConf
from sklearn.metrics import f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger(__name__)


class EncoderLayer(nn.Module):
    def __init__(self, d, heads, ff_mult=4, dropout=0.1):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln1 = nn.LayerNorm(d)
        self.ln2 = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, ff_mult * d), nn.GELU(), nn.Linear(ff_mult * d, d))
        self.drop = nn.Dropout(dropout)

    def forward(self, x, key_pad):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        attn_mask = (~key_pad)[:, None, None, :]
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=0.1 if self.training else 0.0)
        x = x + self.drop(self.proj(h.transpose(1, 2).reshape(B, T, D)))
        return x + self.drop(self.ff(self.ln2(x)))


class LongDocClassifier(nn.Module):
    def __init__(self, vocab_size, num_labels, d_model=512, n_layers=8, heads=8, max_len=4096,
                 pool="cls", grad_ckpt=True):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model, padding_idx=0)
        self.pos = nn.Embedding(max_len, d_model)
        self.layers = nn.ModuleList([EncoderLayer(d_model, heads) for _ in range(n_layers)])
        self.norm = nn.LayerNorm(d_model)
        self.pooler = nn.Sequential(nn.Linear(d_model, d_model), nn.Tanh())
        self.classifier = nn.Linear(d_model, num_labels)
        self.pool = pool
        self.grad_ckpt = grad_ckpt

    def forward(self, input_ids, key_pad):
        pos = torch.arange(input_ids.size(1), device=input_ids.device)
        x = self.embed(input_ids) + self.pos(pos)[None]
        for layer in self.layers:
            if self.grad_ckpt and self.training:
                x = checkpoint(layer, x, key_pad, use_reentrant=True)
            else:
                x = layer(x, key_pad)
        x = self.norm(x)
        if self.pool == "cls":
            feat = self.pooler(x[:, 0])
        else:
            keep = (~key_pad).unsqueeze(-1).to(x.dtype)
            feat = (x * keep).sum(1) / keep.sum(1).clamp(min=1.0)
        return self.classifier(feat)


@torch.no_grad()
def evaluate(model, loader, device, world):
    model.eval()
    preds, golds = [], []
    for ids, pad, y in loader:
        ids, pad = ids.to(device, non_blocking=True), pad.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids, pad)
        preds.append(logits.argmax(-1).cpu())
        golds.append(y)
    local = (torch.cat(preds).tolist(), torch.cat(golds).tolist())
    gathered = [None] * world
    dist.all_gather_object(gathered, local)
    model.train()
    all_p = [p for g in gathered for p in g[0]]
    all_y = [y for g in gathered for y in g[1]]
    return f1_score(all_y, all_p, average="macro"), f1_score(all_y, all_p, average="micro")


@hydra.main(version_base="1.3", config_path="configs", config_name="longdoc")
def main(cfg: DictConfig):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)
    out_dir = HydraConfig.get().runtime.output_dir

    train_ds = instantiate(cfg.data.train, root=to_absolute_path(cfg.data.root), max_len=cfg.model.max_len)
    val_ds = instantiate(cfg.data.val, root=to_absolute_path(cfg.data.root), max_len=cfg.model.max_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=cfg.train.batch_size, sampler=train_sampler,
                              collate_fn=train_ds.collate, num_workers=cfg.data.workers, pin_memory=True,
                              drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=cfg.train.batch_size,
                            sampler=DistributedSampler(val_ds, shuffle=False, drop_last=False),
                            collate_fn=val_ds.collate, num_workers=cfg.data.workers)

    model = LongDocClassifier(cfg.model.vocab_size, cfg.data.num_labels, cfg.model.d_model, cfg.model.n_layers,
                              cfg.model.heads, cfg.model.max_len, cfg.model.pool, cfg.model.grad_ckpt).to(device)
    # the pooler is skipped when pool=mean
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    total = cfg.train.epochs * len(train_loader)
    warm = int(cfg.optim.warmup_ratio * total)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))

    best = -1.0
    step = 0
    for epoch in range(cfg.train.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for ids, pad, y in train_loader:
            ids, pad, y = ids.to(device, non_blocking=True), pad.to(device, non_blocking=True), y.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(ids, pad)
            loss = F.cross_entropy(logits.float(), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if rank == 0 and step % cfg.train.log_every == 0:
                log.info("epoch %d step %d/%d loss %.4f", epoch, step, total, loss.item())

        macro, micro = evaluate(model, val_loader, device, world)
        if rank == 0:
            log.info("epoch %d val macro-F1 %.4f micro-F1 %.4f", epoch, macro, micro)
            if macro > best:
                best = macro
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "macro_f1": macro,
                            "cfg": OmegaConf.to_container(cfg, resolve=True)}, os.path.join(out_dir, "best.pt"))
        best = max(best, macro)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
