"""ViT-B/16 encoder + CXR-BERT initialised cross-attention decoder.

    torchrun --nproc_per_node=4 07_vit_cxrbert_decoder.py conf/vit_cxrbert.yaml data.root=/data/mimic
"""
import os
import sys
import time

import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from f1chexbert import F1CheXbert
from omegaconf import OmegaConf
from PIL import Image
from timm.data import create_transform, resolve_data_config
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer, BertConfig, BertLMHeadModel, get_cosine_schedule_with_warmup

DEFAULTS = OmegaConf.create({
    "data": {"root": "/data/mimic", "train_csv": "splits/train.csv", "val_csv": "splits/val.csv",
             "max_len": 128, "workers": 8},
    "model": {"vit": "vit_base_patch16_224.augreg2_in21k_ft_in1k",
              "text": "microsoft/BiomedVLP-CXR-BERT-general", "drop_path": 0.1},
    "optim": {"lr": 5e-5, "vit_lr": 1e-5, "wd": 0.05, "warmup": 1500, "epochs": 12, "batch": 24},
    "eval": {"max_new": 120},
    "out": "runs/vit_cxrbert",
})


def load_cfg():
    cfg = DEFAULTS
    argv = sys.argv[1:]
    if argv and argv[0].endswith(".yaml"):
        cfg = OmegaConf.merge(cfg, OmegaConf.load(argv[0]))
        argv = argv[1:]
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist(argv))


class ReportCSV(Dataset):
    def __init__(self, csv, root, tf, tok, max_len):
        self.df = pd.read_csv(os.path.join(root, csv))
        self.root, self.tf, self.tok, self.max_len = root, tf, tok, max_len

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        r = self.df.iloc[i]
        x = self.tf(Image.open(os.path.join(self.root, r.jpg)).convert("RGB"))
        t = self.tok(r.report, truncation=True, max_length=self.max_len, padding="max_length",
                     return_tensors="pt")
        return x, t.input_ids[0], t.attention_mask[0], i


class ViTBert(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.vit = timm.create_model(cfg.model.vit, pretrained=True, drop_path_rate=cfg.model.drop_path)
        bcfg = BertConfig.from_pretrained(cfg.model.text, is_decoder=True, add_cross_attention=True)
        self.bert = BertLMHeadModel.from_pretrained(cfg.model.text, config=bcfg)
        self.vis_proj = nn.Linear(self.vit.embed_dim, bcfg.hidden_size)

    def image_embeds(self, x):
        return self.vis_proj(self.vit.forward_features(x))

    def forward(self, x, ids, mask):
        img = self.image_embeds(x)
        out = self.bert(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], encoder_hidden_states=img)
        return out.logits

    @torch.no_grad()
    def greedy(self, x, cls_id, sep_id, max_new):
        img = self.image_embeds(x)
        ids = torch.full((x.size(0), 1), cls_id, dtype=torch.long, device=x.device)
        done = torch.zeros(x.size(0), dtype=torch.bool, device=x.device)
        for _ in range(max_new):
            nxt = self.bert(input_ids=ids, encoder_hidden_states=img).logits[:, -1].argmax(-1)
            nxt = nxt.masked_fill(done, sep_id)
            ids = torch.cat([ids, nxt[:, None]], 1)
            done |= nxt == sep_id
            if done.all():
                break
        return ids


def main():
    cfg = load_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    is_main = rank == 0

    tok = AutoTokenizer.from_pretrained(cfg.model.text, trust_remote_code=True)
    model = ViTBert(cfg)
    dcfg = resolve_data_config({}, model=model.vit)
    train_tf = create_transform(**dcfg, is_training=True, auto_augment=None, hflip=0.0)
    eval_tf = create_transform(**dcfg, is_training=False)
    train_ds = ReportCSV(cfg.data.train_csv, cfg.data.root, train_tf, tok, cfg.data.max_len)
    val_ds = ReportCSV(cfg.data.val_csv, cfg.data.root, eval_tf, tok, cfg.data.max_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=cfg.optim.batch, sampler=train_sampler, drop_last=True,
                          num_workers=cfg.data.workers, pin_memory=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=cfg.optim.batch, sampler=DistributedSampler(val_ds, shuffle=False),
                        num_workers=cfg.data.workers, pin_memory=True)

    model = DDP(model.to(dev), device_ids=[local_rank])
    vit_params = [p for n, p in model.module.named_parameters() if n.startswith("vit.")]
    rest = [p for n, p in model.module.named_parameters() if not n.startswith("vit.")]
    opt = torch.optim.AdamW([{"params": vit_params, "lr": cfg.optim.vit_lr},
                             {"params": rest, "lr": cfg.optim.lr}], weight_decay=cfg.optim.wd)
    total = cfg.optim.epochs * len(train_dl)
    sched = get_cosine_schedule_with_warmup(opt, cfg.optim.warmup, total)
    scaler = torch.cuda.amp.GradScaler()
    chexbert = F1CheXbert(device=dev) if is_main else None
    if is_main:
        os.makedirs(cfg.out, exist_ok=True)
        OmegaConf.save(cfg, os.path.join(cfg.out, "config.yaml"))

    best = 0.0
    for epoch in range(cfg.optim.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for step, (x, ids, mask, _) in enumerate(train_dl):
            x, ids, mask = x.to(dev, non_blocking=True), ids.to(dev), mask.to(dev)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(x, ids, mask)
            tgt = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), tgt.reshape(-1),
                                   ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            if is_main and step % 100 == 0:
                print(f"[{epoch}:{step}/{len(train_dl)}] loss={loss.item():.4f} "
                      f"scale={scaler.get_scale():.0f} {time.time() - tic:.0f}s", flush=True)

        model.eval()
        pairs = []
        for x, ids, _, idx in val_dl:
            with torch.autocast("cuda", dtype=torch.float16):
                gen = model.module.greedy(x.to(dev), tok.cls_token_id, tok.sep_token_id, cfg.eval.max_new)
            pairs += list(zip(idx.tolist(), tok.batch_decode(gen, skip_special_tokens=True)))
        gathered = [None] * world
        dist.all_gather_object(gathered, pairs)
        if is_main:
            hyp = dict(p for part in gathered for p in part)
            keys = sorted(hyp)
            refs = [val_ds.df.report.iloc[k] for k in keys]
            _, _, r14, r5 = chexbert(hyps=[hyp[k] for k in keys], refs=refs)
            f1 = r14["micro avg"]["f1-score"]
            print(f"epoch {epoch} CE micro-F1(14)={f1:.4f} micro-F1(5)={r5['micro avg']['f1-score']:.4f}")
            ck = {"model": model.module.state_dict(), "epoch": epoch, "f1": f1,
                  "cfg": OmegaConf.to_container(cfg)}
            torch.save(ck, os.path.join(cfg.out, "last.pt"))
            if f1 > best:
                best = f1
                torch.save(ck, os.path.join(cfg.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
