"""Fine-tune our stage-2 LLaVA checkpoint on ScienceQA (IMG split) with LoRA.

Answers are a single option letter, so validation decodes one token per question
and we keep the checkpoint with the best validation accuracy.

    torchrun --nproc_per_node 8 15_scienceqa_lora_ddp.py --base runs/stage2-7b --data data/scienceqa \
        --out runs/sqa-lora
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from peft import LoraConfig, get_peft_model
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import (AutoModelForCausalLM, AutoTokenizer, CLIPImageProcessor, CLIPVisionModel,
                          get_linear_schedule_with_warmup)

IGNORE_INDEX = -100
LETTERS = "ABCDE"


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="stage-2 output dir with llm/ and mm_projector.bin")
    ap.add_argument("--vision", default="openai/clip-vit-large-patch14-336")
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--eval_bs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lora_r", type=int, default=64)
    return ap.parse_args()


def build_prompt(ex):
    opts = "\n".join(f"{LETTERS[i]}. {c}" for i, c in enumerate(ex["choices"]))
    ctx = f"Context: {ex['hint']}\n" if ex.get("hint") else ""
    return f"USER: {ctx}Question: {ex['question']}\nOptions:\n{opts}\n" \
           f"Answer with the option's letter from the given choices directly. ASSISTANT:"


class ScienceQA(Dataset):
    def __init__(self, root, split, tok, proc):
        rows = json.load(open(os.path.join(root, f"{split}.json")))
        self.rows = [r for r in rows if r.get("image")]
        self.root, self.tok, self.proc = root, tok, proc

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        ex = self.rows[i]
        prompt = self.tok(build_prompt(ex), add_special_tokens=True).input_ids
        answer = self.tok(" " + LETTERS[ex["answer"]] + "</s>", add_special_tokens=False).input_ids
        img = Image.open(os.path.join(self.root, "images", ex["image"])).convert("RGB")
        px = self.proc(img, return_tensors="pt").pixel_values[0]
        return {"prompt": prompt, "answer": answer, "pixel_values": px, "label": ex["answer"]}


class Collate:
    def __init__(self, pad_id, train):
        self.pad_id, self.train = pad_id, train

    def __call__(self, batch):
        seqs = [b["prompt"] + b["answer"] if self.train else b["prompt"] for b in batch]
        L = max(map(len, seqs))
        ids = torch.full((len(seqs), L), self.pad_id)
        labels = torch.full((len(seqs), L), IGNORE_INDEX)
        mask = torch.zeros((len(seqs), L), dtype=torch.long)
        for i, (s, b) in enumerate(zip(seqs, batch)):
            # left padding so that the last position is the prompt end for decoding
            ids[i, L - len(s):], mask[i, L - len(s):] = torch.tensor(s), 1
            if self.train:
                labels[i, L - len(b["answer"]):] = torch.tensor(b["answer"])
        return ids, mask, labels, torch.stack([b["pixel_values"] for b in batch]), \
            torch.tensor([b["label"] for b in batch])


class LlavaSQA(nn.Module):
    def __init__(self, llm, vision):
        super().__init__()
        self.llm, self.vision = llm, vision
        d = llm.config.hidden_size
        self.mm_projector = nn.Sequential(nn.Linear(vision.config.hidden_size, d), nn.GELU(), nn.Linear(d, d))

    def forward(self, ids, mask, labels, px):
        with torch.no_grad():
            f = self.vision(px, output_hidden_states=True).hidden_states[-2][:, 1:]
        img = self.mm_projector(f)
        txt = self.llm.get_input_embeddings()(ids)
        x = torch.cat([img, txt], 1)
        m = torch.cat([mask.new_ones(img.shape[:2]), mask], 1)
        y = torch.cat([labels.new_full(img.shape[:2], IGNORE_INDEX), labels], 1)
        return self.llm(inputs_embeds=x, attention_mask=m, labels=y)


@torch.no_grad()
def evaluate(model, loader, letter_ids, device):
    model.eval()
    correct, total = 0, 0
    for ids, mask, labels, px, gold in loader:
        logits = model(ids.to(device), mask.to(device), labels.to(device), px.to(device, torch.bfloat16)).logits
        last = logits[:, -1, :][:, letter_ids]
        pred = last.argmax(-1).cpu()
        correct += (pred == gold).sum().item()
        total += gold.numel()
    model.train()
    return correct / max(total, 1)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tok = AutoTokenizer.from_pretrained(os.path.join(args.base, "llm"), use_fast=False)
    tok.pad_token = tok.unk_token
    proc = CLIPImageProcessor.from_pretrained(args.vision)
    llm = AutoModelForCausalLM.from_pretrained(os.path.join(args.base, "llm"), torch_dtype=torch.bfloat16)
    llm = get_peft_model(llm, LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.05,
                                         target_modules=["q_proj", "v_proj", "k_proj", "o_proj"],
                                         task_type="CAUSAL_LM"))
    vision = CLIPVisionModel.from_pretrained(args.vision, torch_dtype=torch.bfloat16).requires_grad_(False)
    model = LlavaSQA(llm, vision)
    model.mm_projector.load_state_dict(
        torch.load(os.path.join(args.base, "mm_projector.bin"), map_location="cpu"))
    model.mm_projector.requires_grad_(False)
    model = DDP(model.to(device, torch.bfloat16), device_ids=[local_rank])

    letter_ids = [tok(" " + c, add_special_tokens=False).input_ids[-1] for c in LETTERS]
    train_ds, val_ds = ScienceQA(args.data, "train", tok, proc), ScienceQA(args.data, "val", tok, proc)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=6,
                              collate_fn=Collate(tok.pad_token_id, True), drop_last=True, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=args.eval_bs, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=4, collate_fn=Collate(tok.pad_token_id, False))

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    total_steps = args.epochs * len(train_loader)
    sched = get_linear_schedule_with_warmup(opt, int(0.05 * total_steps), total_steps)
    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None

    best_acc, step = 0.0, 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for ids, mask, labels, px, _ in train_loader:
            out = model(ids.to(device), mask.to(device), labels.to(device), px.to(device, torch.bfloat16))
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 20 == 0:
                writer.add_scalar("train/loss", out.loss.item(), step)
                print(f"epoch {epoch} step {step}/{total_steps} loss {out.loss.item():.4f} "
                      f"({time.time() - t0:.0f}s)", flush=True)

        acc = evaluate(model.module, val_loader, letter_ids, device)
        if rank == 0:
            writer.add_scalar("val/acc", acc, step)
            print(f"epoch {epoch}: val acc {acc * 100:.2f}", flush=True)
            if acc > best_acc:
                best_acc = acc
                model.module.llm.save_pretrained(os.path.join(args.out, "best"))
                print(f"new best {best_acc * 100:.2f}, saved", flush=True)
        dist.barrier()

    if rank == 0:
        model.module.llm.save_pretrained(os.path.join(args.out, "last"))
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
