"""LLaVA-1.5-13B ChartQA fine-tuning with FSDP, with in-loop generative evaluation.

Decoding goes through the FSDP root forward (prefill + KV-cache steps), so every
layer is unsharded by FSDP itself. All ranks run the same number of decode steps.

    torchrun --nproc_per_node=8 13_llava_chartqa_eval.py --data-dir /data/chartqa --out /ckpt/llava13b-chartqa
"""
import argparse
import functools
import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
from PIL import Image
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoProcessor, LlavaForConditionalGeneration
from transformers.models.clip.modeling_clip import CLIPEncoderLayer
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

PROMPT = "USER: <image>\n{q} Answer with a single word or number. ASSISTANT:"


class ChartQA(Dataset):
    def __init__(self, root, split):
        with open(os.path.join(root, split, f"{split}_augmented.json")) as f:
            self.rows = json.load(f)
        with open(os.path.join(root, split, f"{split}_human.json")) as f:
            self.rows += json.load(f)
        self.img_dir = os.path.join(root, split, "png")

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        img = Image.open(os.path.join(self.img_dir, r["imgname"])).convert("RGB")
        return i, img, r["query"], str(r["label"])


def train_collate(processor):
    def fn(batch):
        _, imgs, qs, ans = zip(*batch)
        prompts = [PROMPT.format(q=q) for q in qs]
        full = [p + " " + a + processor.tokenizer.eos_token for p, a in zip(prompts, ans)]
        enc = processor(text=full, images=list(imgs), return_tensors="pt", padding=True)
        labels = enc["input_ids"].clone()
        labels[enc["attention_mask"] == 0] = -100
        for b, p in enumerate(prompts):
            n_prompt = len(processor(text=p, images=imgs[b], return_tensors="pt")["input_ids"][0])
            pad = int((enc["attention_mask"][b] == 0).sum())  # left padding
            labels[b, :pad + n_prompt] = -100
        enc["labels"] = labels
        return enc
    return fn


def eval_collate(processor):
    def fn(batch):
        idx, imgs, qs, ans = zip(*batch)
        enc = processor(text=[PROMPT.format(q=q) for q in qs], images=list(imgs), return_tensors="pt",
                        padding=True)
        return list(idx), enc, list(ans)
    return fn


def relaxed_match(pred, gold, tol=0.05):
    try:
        p, g = float(pred.strip().rstrip("%")), float(gold.strip().rstrip("%"))
        return abs(p - g) <= tol * abs(g) if g != 0 else p == g
    except ValueError:
        return pred.strip().lower() == gold.strip().lower()


@torch.no_grad()
def greedy_decode(model, enc, eos_id, max_new_tokens):
    ids, attn = enc["input_ids"], enc["attention_mask"]
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=attn, pixel_values=enc["pixel_values"],
                position_ids=pos, use_cache=True)
    past = out.past_key_values
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    tokens = [nxt]
    done = nxt.squeeze(1) == eos_id
    for _ in range(max_new_tokens - 1):
        # keep stepping even if this rank's rows are finished: the forward is a collective
        attn = torch.cat([attn, torch.ones_like(nxt)], dim=1)
        pos = pos[:, -1:] + 1
        out = model(input_ids=nxt, attention_mask=attn, position_ids=pos, past_key_values=past, use_cache=True)
        past = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        nxt = torch.where(done[:, None], torch.full_like(nxt, eos_id), nxt)
        tokens.append(nxt)
        done |= nxt.squeeze(1) == eos_id
    return torch.cat(tokens, dim=1)


def evaluate(model, loader, processor, device, max_new_tokens=12):
    model.eval()
    local = {}
    for idx, enc, answers in loader:
        enc = enc.to(device)
        enc["pixel_values"] = enc["pixel_values"].to(torch.bfloat16)
        gen = greedy_decode(model, enc, processor.tokenizer.eos_token_id, max_new_tokens)
        preds = processor.batch_decode(gen, skip_special_tokens=True)
        for i, p, a in zip(idx, preds, answers):
            local[i] = float(relaxed_match(p, a))  # keyed by index: sampler padding repeats drop out
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    merged = {}
    for g in gathered:
        merged.update(g)
    model.train()
    return sum(merged.values()) / max(1, len(merged))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llava-hf/llava-1.5-13b-hf")
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--eval-bs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--resume", default=None, help="sharded checkpoint dir (same world size not required)")
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    processor = AutoProcessor.from_pretrained(args.model)
    processor.tokenizer.padding_side = "left"
    model = LlavaForConditionalGeneration.from_pretrained(args.model, torch_dtype=torch.float32)
    model.vision_tower.requires_grad_(False)
    policy = functools.partial(transformer_auto_wrap_policy,
                               transformer_layer_cls={LlamaDecoderLayer, CLIPEncoderLayer})
    model = FSDP(model, auto_wrap_policy=policy, device_id=device, use_orig_params=True,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                buffer_dtype=torch.bfloat16))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)

    start_epoch = 0
    if args.resume:
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            state = {"model": model.state_dict()}
            dcp.load(state, checkpoint_id=args.resume)
            model.load_state_dict(state["model"])
            osd = load_sharded_optimizer_state_dict(model_state_dict=state["model"], optimizer_key="optim",
                                                    storage_reader=dcp.FileSystemReader(args.resume))
            optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, osd["optim"]))
        with open(os.path.join(args.resume, "epoch.json")) as f:
            start_epoch = json.load(f)["epoch"] + 1

    train_ds, val_ds = ChartQA(args.data_dir, "train"), ChartQA(args.data_dir, "val")
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=8,
                              collate_fn=train_collate(processor), drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.eval_bs, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=4, collate_fn=eval_collate(processor))

    for epoch in range(start_epoch, args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        for it, batch in enumerate(train_loader):
            batch = batch.to(device)
            batch["pixel_values"] = batch["pixel_values"].to(torch.bfloat16)
            loss = model(**batch).loss
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if it % 50 == 0 and rank == 0:
                print(f"epoch {epoch} it {it}/{len(train_loader)} loss {loss.item():.4f}", flush=True)

        acc = evaluate(model, val_loader, processor, device)
        if rank == 0:
            print(f"epoch {epoch} ChartQA relaxed acc {acc:.4f}", flush=True)

        ckpt = os.path.join(args.out, f"epoch{epoch}")
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optimizer)}
            dcp.save(state, checkpoint_id=ckpt)
        if rank == 0:
            with open(os.path.join(ckpt, "epoch.json"), "w") as f:
                json.dump({"epoch": epoch, "acc": acc}, f)
        dist.barrier()

    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        full = model.state_dict()
    if rank == 0:
        torch.save(full, os.path.join(args.out, "llava_chartqa_final.bin"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
