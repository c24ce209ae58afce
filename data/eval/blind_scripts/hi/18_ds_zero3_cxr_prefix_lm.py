"""
Prefix-LM report generator: ViT-B/16 patch tokens -> perceiver resampler (32 queries) -> BioMedLM
(GPT-2 arch, 2.7B) as decoder. DeepSpeed ZeRO-3, bf16.

    deepspeed --num_gpus 4 18_ds_zero3_cxr_prefix_lm.py --train data/rrg/train.jsonl --val data/rrg/val.jsonl \
        --image-root /data/mimic-cxr-jpg/files --out ckpt/prefix_lm
"""
import argparse
import json
import os

import deepspeed
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from nltk.translate.bleu_score import corpus_bleu
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.integrations import HfDeepSpeedConfig

NEW_TOKENS = ["<findings>", "<impression>"]


class Resampler(nn.Module):
    def __init__(self, dim_in, dim_out, n_queries=32, heads=8):
        super().__init__()
        self.queries = nn.Parameter(torch.randn(n_queries, dim_out) * 0.02)
        self.kv = nn.Linear(dim_in, dim_out)
        self.attn = nn.MultiheadAttention(dim_out, heads, batch_first=True)
        self.ff = nn.Sequential(nn.LayerNorm(dim_out), nn.Linear(dim_out, 4 * dim_out), nn.GELU(),
                                nn.Linear(4 * dim_out, dim_out))

    def forward(self, x):
        kv = self.kv(x)
        q = self.queries.unsqueeze(0).expand(x.size(0), -1, -1)
        h = q + self.attn(q, kv, kv, need_weights=False)[0]
        return h + self.ff(h)


class PrefixReportLM(nn.Module):
    def __init__(self, lm_name, vit_name):
        super().__init__()
        self.vit = timm.create_model(vit_name, pretrained=True, num_classes=0)
        self.lm = AutoModelForCausalLM.from_pretrained(lm_name, torch_dtype=torch.bfloat16)
        self.resampler = Resampler(self.vit.num_features, self.lm.config.n_embd)

    def prefix(self, images):
        return self.resampler(self.vit.forward_features(images))

    def forward(self, images, input_ids, attention_mask, labels):
        pre = self.prefix(images)
        tok = self.lm.get_input_embeddings()(input_ids)
        embeds = torch.cat([pre.to(tok.dtype), tok], dim=1)
        att = torch.cat([attention_mask.new_ones(pre.shape[:2]), attention_mask], dim=1)
        lab = torch.cat([labels.new_full(pre.shape[:2], -100), labels], dim=1)
        return self.lm(inputs_embeds=embeds, attention_mask=att, labels=lab).loss

    @torch.no_grad()
    def generate_reports(self, images, prompt_ids, max_new_tokens=150):
        pre = self.prefix(images)
        prompt = self.lm.get_input_embeddings()(prompt_ids).expand(images.size(0), -1, -1)
        embeds = torch.cat([pre.to(prompt.dtype), prompt], dim=1)
        att = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        # synced_gpus: under ZeRO-3 every rank has to keep running forwards until all ranks are done
        return self.lm.generate(inputs_embeds=embeds, attention_mask=att, max_new_tokens=max_new_tokens,
                                do_sample=False, num_beams=1, synced_gpus=True,
                                pad_token_id=self.lm.config.eos_token_id)


class ReportJsonl(Dataset):
    def __init__(self, path, image_root, tok, max_len, train):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]
        self.image_root, self.tok, self.max_len = image_root, tok, max_len
        norm = T.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
        self.tf = T.Compose(([T.RandomResizedCrop(224, scale=(0.8, 1))] if train else [T.Resize((224, 224))])
                            + [T.ToTensor(), norm])

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        img = self.tf(Image.open(os.path.join(self.image_root, r["image"])).convert("RGB"))
        text = f"<findings> {r['findings']} <impression> {r['impression']}{self.tok.eos_token}"
        enc = self.tok(text, max_length=self.max_len, truncation=True, padding="max_length", return_tensors="pt")
        ids, att = enc.input_ids[0], enc.attention_mask[0]
        return img, ids, att, ids.masked_fill(att == 0, -100), i


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--image-root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--lm", default="stanford-crfm/BioMedLM")
    ap.add_argument("--vit", default="vit_base_patch16_224.augreg_in21k")
    ap.add_argument("--micro-bs", type=int, default=8)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--local_rank", type=int, default=-1)  # passed by the deepspeed launcher
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    tok = AutoTokenizer.from_pretrained(args.lm)
    tok.pad_token = tok.eos_token
    tok.add_special_tokens({"additional_special_tokens": NEW_TOKENS})

    train_ds = ReportJsonl(args.train, args.image_root, tok, args.max_len, True)
    val_ds = ReportJsonl(args.val, args.image_root, tok, args.max_len, False)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, args.micro_bs, sampler=train_sampler, num_workers=6, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, args.micro_bs, sampler=val_sampler, num_workers=6)

    steps_total = args.epochs * len(train_dl) // args.accum
    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_bs,
        "gradient_accumulation_steps": args.accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.98], "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                                 "warmup_num_steps": max(1, steps_total // 50), "total_num_steps": steps_total}},
        "zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_gather_16bit_weights_on_model_save": True},
        "wall_clock_breakdown": False,
    }
    dschf = HfDeepSpeedConfig(ds_config)  # noqa: F841  (must exist before from_pretrained)

    model = PrefixReportLM(args.lm, args.vit)
    n_new = len(NEW_TOKENS)
    model.lm.resize_token_embeddings(len(tok))
    emb = model.lm.get_input_embeddings()
    # the weight is partitioned: gather it, edit on rank 0, DeepSpeed re-partitions on exit
    with deepspeed.zero.GatheredParameters(emb.weight, modifier_rank=0):
        if rank == 0:
            emb.weight.data[-n_new:] = emb.weight.data[:-n_new].mean(dim=0, keepdim=True)

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    if rank == 0:
        n_params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
        print(f"{n_params / 1e9:.2f}B parameters, {world} ranks, global batch {args.micro_bs * args.accum * world}")

    _, client = engine.load_checkpoint(args.out) if os.path.isdir(args.out) else (None, None)
    start_epoch = client["epoch"] + 1 if client else 0
    prompt_ids = torch.tensor([[tok.convert_tokens_to_ids("<findings>")]], device=engine.device)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        engine.train()
        for step, (img, ids, att, lab, _) in enumerate(train_dl):
            img = img.to(engine.device, dtype=torch.bfloat16)
            loss = engine(img, ids.to(engine.device), att.to(engine.device), lab.to(engine.device))
            engine.backward(loss)
            engine.step()
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step}/{len(train_dl)} loss {loss.item():.4f}", flush=True)

        engine.eval()
        stats = torch.zeros(2, device=engine.device)
        local = []
        with torch.no_grad():
            for img, ids, att, lab, idx in val_dl:
                img = img.to(engine.device, dtype=torch.bfloat16)
                stats[0] += engine(img, ids.to(engine.device), att.to(engine.device), lab.to(engine.device)).float()
                stats[1] += 1
                gen = engine.module.generate_reports(img, prompt_ids)
                for i, g, ref in zip(idx.tolist(), tok.batch_decode(gen, skip_special_tokens=True),
                                     tok.batch_decode(ids, skip_special_tokens=True)):
                    local.append((i, g.strip(), ref.strip()))
        dist.all_reduce(stats)
        everyone = [None] * world
        dist.all_gather_object(everyone, local)
        if rank == 0:
            merged = {i: (g, r) for part in everyone for i, g, r in part}
            keys = sorted(merged)
            bleu = corpus_bleu([[merged[k][1].split()] for k in keys], [merged[k][0].split() for k in keys])
            print(f"epoch {epoch} val loss {(stats[0] / stats[1]).item():.4f} BLEU-4 {bleu:.4f}", flush=True)

        # collective: every rank writes its own ZeRO shards
        engine.save_checkpoint(args.out, tag=f"epoch{epoch}", client_state={"epoch": epoch})

    engine.save_16bit_model(os.path.join(args.out, "hf_export"), "model.bin")
    if rank == 0:
        tok.save_pretrained(os.path.join(args.out, "hf_export"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
