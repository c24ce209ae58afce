#!/usr/bin/env python
"""DPO for SmolLM2 chat models, HF-format checkpoints every --save_steps (keeps the last --keep).

    torchrun --standalone --nproc_per_node=8 17_dpo_smollm_ckpt_rotate.py \
        --model_name_or_path ckpts/smollm2-1.7b-sft --data data/uf_pairs_chat.jsonl --output_dir runs/dpo-smol
"""
import argparse
import glob
import json
import logging
import os
import shutil

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

log = logging.getLogger(__name__)
IGNORE_INDEX = -100


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_name_or_path", required=True)
    ap.add_argument("--data", required=True, help="jsonl with 'chosen' / 'rejected' message lists")
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--beta", type=float, default=0.05)
    ap.add_argument("--learning_rate", type=float, default=1e-6)
    ap.add_argument("--warmup_ratio", type=float, default=0.1)
    ap.add_argument("--per_device_train_batch_size", type=int, default=4)
    ap.add_argument("--num_train_epochs", type=int, default=1)
    ap.add_argument("--max_length", type=int, default=1024)
    ap.add_argument("--save_steps", type=int, default=200)
    ap.add_argument("--keep", type=int, default=3)
    ap.add_argument("--logging_steps", type=int, default=10)
    return ap.parse_args()


def encode_conversation(tok, messages, max_length):
    """Tokenise a chat; the final assistant turn is the response, everything before it is the prompt."""
    prompt_ids = tok.apply_chat_template(messages[:-1], tokenize=True, add_generation_prompt=True)
    full_ids = tok.apply_chat_template(messages, tokenize=True)
    response_ids = full_ids[len(prompt_ids):]
    if len(prompt_ids) + len(response_ids) > max_length:
        prompt_ids = prompt_ids[-(max_length // 2):]
        response_ids = response_ids[: max_length - len(prompt_ids)]
    return prompt_ids + response_ids, [IGNORE_INDEX] * len(prompt_ids) + response_ids


class ChatPairs(Dataset):
    def __init__(self, path, tok, max_length):
        self.examples = []
        with open(path) as f:
            for line in f:
                ex = json.loads(line)
                c_ids, c_lab = encode_conversation(tok, ex["chosen"], max_length)
                r_ids, r_lab = encode_conversation(tok, ex["rejected"], max_length)
                self.examples.append((c_ids, c_lab, r_ids, r_lab))

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, idx):
        return self.examples[idx]


class DPOCollator:
    def __init__(self, pad_token_id):
        self.pad = pad_token_id

    def __call__(self, feats):
        ids = [f[0] for f in feats] + [f[2] for f in feats]
        labs = [f[1] for f in feats] + [f[3] for f in feats]
        L = max(map(len, ids))
        input_ids = torch.full((len(ids), L), self.pad, dtype=torch.long)
        labels = torch.full((len(ids), L), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(ids), L), dtype=torch.long)
        for i, (a, b) in enumerate(zip(ids, labs)):
            input_ids[i, : len(a)] = torch.tensor(a)
            labels[i, : len(b)] = torch.tensor(b)
            attention_mask[i, : len(a)] = 1
        return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def batch_logps(model, batch):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits = logits[:, :-1].float()
    labels = batch["labels"][:, 1:]
    mask = labels.ne(IGNORE_INDEX)
    token_logps = torch.gather(logits.log_softmax(-1), 2, labels.clamp(min=0).unsqueeze(2)).squeeze(2)
    logps = (token_logps * mask).sum(-1)
    half = logps.shape[0] // 2
    return logps[:half], logps[half:]


def save_checkpoint(model, tok, optimizer, scheduler, step, output_dir, keep):
    path = os.path.join(output_dir, f"checkpoint-{step}")
    os.makedirs(path, exist_ok=True)
    model.module.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": step},
               os.path.join(path, "trainer_state.pt"))
    ckpts = sorted(glob.glob(os.path.join(output_dir, "checkpoint-*")), key=lambda p: int(p.rsplit("-", 1)[1]))
    for old in ckpts[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(format=f"[rank{rank}] %(asctime)s %(message)s",
                        level=logging.INFO if rank == 0 else logging.WARN)

    tok = AutoTokenizer.from_pretrained(args.model_name_or_path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    os.makedirs(args.output_dir, exist_ok=True)

    dataset = ChatPairs(args.data, tok, args.max_length)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.per_device_train_batch_size, sampler=sampler,
                        collate_fn=DPOCollator(tok.pad_token_id), num_workers=2, pin_memory=True)

    policy = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, torch_dtype=torch.float32)
    policy.config.use_cache = False
    policy.to(device)
    reference = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, torch_dtype=torch.bfloat16)
    reference.to(device).eval().requires_grad_(False)
    model = DDP(policy, device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
    total_steps = len(loader) * args.num_train_epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)
    log.info("examples=%d world=%d global_batch=%d total_steps=%d", len(dataset), world_size,
             args.per_device_train_batch_size * world_size, total_steps)

    global_step = 0
    for epoch in range(args.num_train_epochs):
        sampler.set_epoch(epoch)
        model.train()
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            pol_c, pol_r = batch_logps(model, batch)
            with torch.no_grad():
                ref_c, ref_r = batch_logps(reference, batch)
            pi_logratios = pol_c - pol_r
            ref_logratios = ref_c - ref_r
            loss = -F.logsigmoid(args.beta * (pi_logratios - ref_logratios)).mean()
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1

            if global_step % args.logging_steps == 0:
                chosen_r = args.beta * (pol_c - ref_c).detach()
                rejected_r = args.beta * (pol_r - ref_r).detach()
                m = torch.stack([loss.detach(), chosen_r.mean(), rejected_r.mean(),
                                 (chosen_r > rejected_r).float().mean(), grad_norm])
                dist.all_reduce(m, op=dist.ReduceOp.AVG)
                log.info("step %d loss %.4f r_chosen %.3f r_rejected %.3f acc %.3f gnorm %.2f lr %.2e",
                         global_step, *[x.item() for x in m], scheduler.get_last_lr()[0])

            if global_step % args.save_steps == 0:
                save_checkpoint(model, tok, optimizer, scheduler, global_step, args.output_dir, args.keep)
                log.info("saved checkpoint-%d", global_step)

    dist.barrier()
    if rank == 0:
        model.module.save_pretrained(os.path.join(args.output_dir, "final"), safe_serialization=True)
        tok.save_pretrained(os.path.join(args.output_dir, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
