"""
Stage 2 of our Phi-2 based VLM: full fine-tuning of the LLM and projector on
visual instruction data, with periodic VQA-accuracy evaluation by greedy decoding.

Launch (one node, 8 GPUs):
    torchrun --standalone --nproc_per_node 8 06_stage2_phi_vqa_eval.py \
        --train_json data/llava_instruct_150k.json --val_json data/textvqa_val_2k.json
"""
import argparse
import functools
import json
import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoModelForCausalLM, AutoTokenizer, CLIPImageProcessor, CLIPVisionModel,
                          get_cosine_schedule_with_warmup)

IGNORE_INDEX = -100


@dataclass
class Cfg:
    llm: str = "microsoft/phi-2"
    vision: str = "openai/clip-vit-large-patch14-336"
    projector: str = "ckpt/phi2-stage1/mm_projector.bin"
    train_json: str = ""
    val_json: str = ""
    image_dir: str = "data/images"
    out_dir: str = "ckpt/phi2-stage2"
    batch_size: int = 8
    lr: float = 2e-5
    epochs: int = 1
    max_len: int = 2048
    eval_every: int = 1000
    max_new_tokens: int = 16


def get_cfg():
    cfg = Cfg()
    ap = argparse.ArgumentParser()
    for k, v in vars(cfg).items():
        ap.add_argument(f"--{k}", type=type(v), default=v)
    return Cfg(**vars(ap.parse_args()))


def fmt_prompt(question):
    return f"Instruct: {question}\nOutput:"


class InstructData(Dataset):
    def __init__(self, path, image_dir, tok, proc, max_len, train=True):
        self.rows = json.load(open(path))
        self.image_dir, self.tok, self.proc, self.max_len, self.train = image_dir, tok, proc, max_len, train

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        px = self.proc(Image.open(os.path.join(self.image_dir, r["image"])).convert("RGB"),
                       return_tensors="pt")["pixel_values"][0]
        if not self.train:
            ids = self.tok(fmt_prompt(r["question"]), return_tensors="pt").input_ids[0]
            return {"input_ids": ids, "pixel_values": px, "qid": r["question_id"], "answers": r["answers"]}
        ids, labels = [], []
        conv = r["conversations"]
        for q, a in zip(conv[0::2], conv[1::2]):
            p = self.tok(fmt_prompt(q["value"].replace("<image>", "").strip()), add_special_tokens=False).input_ids
            t = self.tok(" " + a["value"] + self.tok.eos_token, add_special_tokens=False).input_ids
            ids += p + t
            labels += [IGNORE_INDEX] * len(p) + t
        return {"input_ids": torch.tensor(ids[: self.max_len]), "labels": torch.tensor(labels[: self.max_len]),
                "pixel_values": px}


def train_collate(batch, pad_id):
    ids = nn.utils.rnn.pad_sequence([b["input_ids"] for b in batch], batch_first=True, padding_value=pad_id)
    lab = nn.utils.rnn.pad_sequence([b["labels"] for b in batch], batch_first=True, padding_value=IGNORE_INDEX)
    return {"input_ids": ids, "labels": lab, "attention_mask": (ids != pad_id).long(),
            "pixel_values": torch.stack([b["pixel_values"] for b in batch])}


class PhiVLM(nn.Module):
    def __init__(self, llm, vision):
        super().__init__()
        self.llm, self.vision = llm, vision
        d = llm.config.hidden_size
        self.mm_projector = nn.Sequential(nn.Linear(vision.config.hidden_size, d), nn.GELU(), nn.Linear(d, d))

    def _embed(self, input_ids, attention_mask, pixel_values):
        with torch.no_grad():
            f = self.vision(pixel_values, output_hidden_states=True).hidden_states[-2][:, 1:]
        img = self.mm_projector(f).to(self.llm.dtype)
        txt = self.llm.get_input_embeddings()(input_ids)
        mask = torch.cat([attention_mask.new_ones(img.shape[:2]), attention_mask], dim=1)
        return torch.cat([img, txt], dim=1), mask

    def forward(self, input_ids, attention_mask, labels, pixel_values):
        x, mask = self._embed(input_ids, attention_mask, pixel_values)
        labels = torch.cat([labels.new_full((labels.size(0), x.size(1) - labels.size(1)), IGNORE_INDEX), labels], 1)
        return self.llm(inputs_embeds=x, attention_mask=mask, labels=labels)

    @torch.no_grad()
    def generate(self, input_ids, pixel_values, **kwargs):
        x, mask = self._embed(input_ids, torch.ones_like(input_ids), pixel_values)
        return self.llm.generate(inputs_embeds=x, attention_mask=mask, **kwargs)


def normalize(ans):
    ans = ans.lower().strip().rstrip(".")
    return re.sub(r"\b(a|an|the)\b", " ", ans).strip()


def vqa_accuracy(pred, answers):
    pred = normalize(pred)
    return min(1.0, sum(normalize(a) == pred for a in answers) / 3.0)


def evaluate(model, loader, tok, device, cfg):
    model.eval()
    results = []
    for b in loader:
        out = model.generate(input_ids=b["input_ids"].unsqueeze(0).to(device),
                             pixel_values=b["pixel_values"].unsqueeze(0).to(device, torch.bfloat16),
                             max_new_tokens=cfg.max_new_tokens, do_sample=False,
                             pad_token_id=tok.eos_token_id)
        pred = tok.decode(out[0], skip_special_tokens=True).strip()
        results.append({"qid": b["qid"], "pred": pred, "acc": vqa_accuracy(pred, b["answers"])})
    all_results = [None] * dist.get_world_size()
    dist.all_gather_object(all_results, results)
    model.train()
    merged = {r["qid"]: r for part in all_results for r in part}
    return sum(r["acc"] for r in merged.values()) / len(merged), list(merged.values())


def main():
    cfg = get_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{local_rank}")

    tok = AutoTokenizer.from_pretrained(cfg.llm)
    tok.pad_token = tok.eos_token
    proc = CLIPImageProcessor.from_pretrained(cfg.vision)
    llm = AutoModelForCausalLM.from_pretrained(cfg.llm, torch_dtype=torch.bfloat16)
    vision = CLIPVisionModel.from_pretrained(cfg.vision, torch_dtype=torch.bfloat16).requires_grad_(False)
    model = PhiVLM(llm, vision)
    model.mm_projector.load_state_dict(torch.load(cfg.projector, map_location="cpu"))
    model = model.to(device=device, dtype=torch.bfloat16)
    model = DistributedDataParallel(model, device_ids=[local_rank])

    train_ds = InstructData(cfg.train_json, cfg.image_dir, tok, proc, cfg.max_len)
    val_ds = InstructData(cfg.val_json, cfg.image_dir, tok, proc, cfg.max_len, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, cfg.batch_size, sampler=sampler, num_workers=6, pin_memory=True,
                              drop_last=True, collate_fn=functools.partial(train_collate, pad_id=tok.pad_token_id))
    val_loader = DataLoader(val_ds, batch_size=None, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=2)

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0)
    total = cfg.epochs * len(train_loader)
    sched = get_cosine_schedule_with_warmup(opt, int(0.03 * total), total)

    step, best = 0, -1.0
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            batch["pixel_values"] = batch["pixel_values"].to(torch.bfloat16)
            loss = model(**batch).loss
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 20 == 0:
                print(f"[{epoch}] step {step}/{total} loss {loss.item():.4f}", flush=True)
            if step % cfg.eval_every == 0 or step == total:
                acc, preds = evaluate(model, val_loader, tok, device, cfg)
                if rank == 0:
                    print(f"step {step}: textvqa acc {acc * 100:.2f}", flush=True)
                    os.makedirs(cfg.out_dir, exist_ok=True)
                    json.dump(preds, open(os.path.join(cfg.out_dir, f"preds_{step}.json"), "w"))
                    if acc > best:
                        best = acc
                        model.module.llm.save_pretrained(os.path.join(cfg.out_dir, "best"))
                        torch.save(model.module.mm_projector.state_dict(),
                                   os.path.join(cfg.out_dir, "best", "mm_projector.bin"))
                dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
