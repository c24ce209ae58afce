"""LoRA fine-tuning of a LLaVA-style model (frozen CLIP tower + trained projector +
LoRA on the LLM) on GQA-style short-answer VQA, exact-match eval by generation.

    torchrun --nproc_per_node=4 12_llava_lora_gqa.py --train gqa_train_balanced.jsonl \
        --val gqa_testdev_balanced.jsonl --images /data/gqa/images --projector stage1/mm_projector.bin
"""
import argparse
import json
import os
import re

import torch
import torch.distributed as dist
import torch.nn as nn
from peft import LoraConfig, get_peft_model
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, CLIPImageProcessor, CLIPVisionModel

PROMPT = "USER: <image>\n{q}\nAnswer the question using a single word or phrase. ASSISTANT:"


class GQA(Dataset):
    def __init__(self, path, images, improc):
        self.rows = [json.loads(l) for l in open(path)]
        self.images, self.improc = images, improc

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        img = Image.open(os.path.join(self.images, r["imageId"] + ".jpg")).convert("RGB")
        return self.improc(img, return_tensors="pt").pixel_values[0], r["question"], r["answer"], i


class VisionLanguageModel(nn.Module):
    def __init__(self, vision, llm, tokenizer):
        super().__init__()
        self.vision = vision
        self.llm = llm
        self.tok = tokenizer
        self.projector = nn.Sequential(nn.Linear(vision.config.hidden_size, llm.config.hidden_size), nn.GELU(),
                                       nn.Linear(llm.config.hidden_size, llm.config.hidden_size))

    def embed(self, pixel_values, prompts, answers=None):
        with torch.no_grad():
            feats = self.vision(pixel_values, output_hidden_states=True).hidden_states[-2][:, 1:]
        img = self.projector(feats)
        embeds, labels = [], []
        emb_layer = self.llm.get_input_embeddings()
        for b, p in enumerate(prompts):
            pre, post = p.split("<image>")
            pre_ids = self.tok(pre, return_tensors="pt").input_ids[0].to(img.device)
            post_ids = self.tok(post, add_special_tokens=False, return_tensors="pt").input_ids[0].to(img.device)
            parts = [emb_layer(pre_ids), img[b].to(emb_layer.weight.dtype), emb_layer(post_ids)]
            lab = [torch.full((len(pre_ids) + img.shape[1] + len(post_ids),), -100, device=img.device)]
            if answers is not None:
                a_ids = self.tok(" " + answers[b] + self.tok.eos_token, add_special_tokens=False,
                                 return_tensors="pt").input_ids[0].to(img.device)
                parts.append(emb_layer(a_ids))
                lab.append(a_ids)
            embeds.append(torch.cat(parts))
            labels.append(torch.cat(lab))
        # left-pad so generation continues right after the prompt
        L = max(e.shape[0] for e in embeds)
        D = embeds[0].shape[1]
        x = embeds[0].new_zeros(len(embeds), L, D)
        y = torch.full((len(embeds), L), -100, device=img.device, dtype=torch.long)
        mask = torch.zeros(len(embeds), L, device=img.device, dtype=torch.long)
        for b, (e, l) in enumerate(zip(embeds, labels)):
            x[b, L - len(e):], y[b, L - len(l):], mask[b, L - len(e):] = e, l, 1
        return x, y, mask

    def forward(self, pixel_values, prompts, answers):
        x, y, mask = self.embed(pixel_values, prompts, answers)
        return self.llm(inputs_embeds=x, attention_mask=mask, labels=y).loss

    @torch.no_grad()
    def generate(self, pixel_values, prompts, max_new_tokens=10):
        x, _, mask = self.embed(pixel_values, prompts)
        out = self.llm.generate(inputs_embeds=x, attention_mask=mask, max_new_tokens=max_new_tokens,
                                do_sample=False, pad_token_id=self.tok.pad_token_id)
        return [s.strip() for s in self.tok.batch_decode(out, skip_special_tokens=True)]


def normalize(s):
    s = s.lower().strip().rstrip(".")
    return re.sub(r"\b(a|an|the)\b", "", s).strip()


def collate(batch):
    pix, qs, ans, idx = zip(*batch)
    return torch.stack(pix), [PROMPT.format(q=q) for q in qs], list(ans), torch.tensor(idx)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    hits = torch.zeros(2, device=device)
    for pix, prompts, answers, _ in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outs = model.generate(pix.to(device), prompts)
        hits[0] += sum(normalize(o) == normalize(a) for o, a in zip(outs, answers))
        hits[1] += len(answers)
    dist.all_reduce(hits)
    model.train()
    return (hits[0] / hits[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llm", default="lmsys/vicuna-7b-v1.5")
    ap.add_argument("--vision", default="openai/clip-vit-large-patch14-336")
    ap.add_argument("--projector", required=True)
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--images", required=True)
    ap.add_argument("--out", default="ckpt/llava_lora_gqa")
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--eval-every", type=int, default=2000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.llm, use_fast=False)
    tok.pad_token = tok.unk_token
    improc = CLIPImageProcessor.from_pretrained(args.vision)
    vision = CLIPVisionModel.from_pretrained(args.vision, torch_dtype=torch.bfloat16).requires_grad_(False)
    llm = AutoModelForCausalLM.from_pretrained(args.llm, torch_dtype=torch.bfloat16)
    llm = get_peft_model(llm, LoraConfig(r=64, lora_alpha=16, lora_dropout=0.05, task_type="CAUSAL_LM",
                                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                         "gate_proj", "up_proj", "down_proj"]))
    model = VisionLanguageModel(vision, llm, tok)
    model.projector.load_state_dict(torch.load(args.projector, map_location="cpu"))
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    train_ds, val_ds = GQA(args.train, args.images, improc), GQA(args.val, args.images, improc)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=6,
                              collate_fn=collate, drop_last=True, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=32, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=4, collate_fn=collate)

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    total = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total, pct_start=0.03)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"trainable {sum(p.numel() for p in params) / 1e6:.1f}M params")

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for pix, prompts, answers, _ in train_loader:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(pix.to(device, non_blocking=True), prompts, answers)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 20 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step}/{total} loss {l.item():.4f}", flush=True)
            if step % args.eval_every == 0 or step == total:
                acc = evaluate(model, val_loader, device)
                if rank == 0:
                    print(f"step {step}: testdev accuracy {acc * 100:.2f}")
                    model.module.llm.save_pretrained(os.path.join(args.out, f"step{step}"))
                    torch.save(model.module.projector.state_dict(),
                               os.path.join(args.out, f"step{step}", "mm_projector.bin"))
                dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
