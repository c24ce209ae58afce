"""Small IMPALA (monobeast-style) for Atari.

Actors run in separate processes and write rollouts into shared-memory buffers,
the learner thread(s) pull batches and train on the GPU. Actors do inference on the
second GPU so the learner GPU is not disturbed.
"""
import argparse
import logging
import os
import threading
import time
import timeit
import traceback

import gym
import numpy as np
import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import vtrace  # local copy of torchbeast/core/vtrace.py

logging.basicConfig(format="[%(levelname)s:%(process)d %(module)s:%(lineno)d %(asctime)s] %(message)s", level=logging.INFO)
log = logging.getLogger("impala")

parser = argparse.ArgumentParser(description="IMPALA")
parser.add_argument("--env", type=str, default="PongNoFrameskip-v4")
parser.add_argument("--savedir", default="~/logs/impala")
parser.add_argument("--num_actors", default=16, type=int)
parser.add_argument("--total_steps", default=50_000_000, type=int)
parser.add_argument("--batch_size", default=32, type=int)
parser.add_argument("--unroll_length", default=80, type=int)
parser.add_argument("--num_buffers", default=None, type=int)
parser.add_argument("--num_learner_threads", default=2, type=int)
parser.add_argument("--learner_device", default="cuda:0")
parser.add_argument("--actor_device", default="cuda:1")
parser.add_argument("--entropy_cost", default=0.01, type=float)
parser.add_argument("--baseline_cost", default=0.5, type=float)
parser.add_argument("--discounting", default=0.99, type=float)
parser.add_argument("--learning_rate", default=6e-4, type=float)
parser.add_argument("--alpha", default=0.99, type=float)
parser.add_argument("--epsilon", default=0.01, type=float)
parser.add_argument("--grad_norm_clipping", default=40.0, type=float)


def make_env(name, seed):
    env = gym.make(name)
    env = gym.wrappers.AtariPreprocessing(env, frame_skip=4, screen_size=84, grayscale_obs=True, noop_max=30)
    env = gym.wrappers.FrameStack(env, 4)
    env.seed(seed)
    return env


class AtariNet(nn.Module):
    def __init__(self, num_actions):
        super().__init__()
        self.num_actions = num_actions
        self.conv1 = nn.Conv2d(4, 32, kernel_size=8, stride=4)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=4, stride=2)
        self.conv3 = nn.Conv2d(64, 64, kernel_size=3, stride=1)
        self.fc = nn.Linear(3136, 512)
        self.policy = nn.Linear(512, num_actions)
        self.baseline = nn.Linear(512, 1)

    def forward(self, frame):
        # frame: [T, B, 4, 84, 84] uint8
        T, B = frame.shape[:2]
        x = frame.reshape(T * B, *frame.shape[2:]).float() / 255.0
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.relu(self.conv3(x))
        x = F.relu(self.fc(x.view(T * B, -1)))
        logits = self.policy(x)
        baseline = self.baseline(x)
        if self.training:
            action = torch.multinomial(F.softmax(logits, dim=1), num_samples=1)
        else:
            action = torch.argmax(logits, dim=1)
        return dict(
            policy_logits=logits.view(T, B, self.num_actions),
            baseline=baseline.view(T, B),
            action=action.view(T, B),
        )


def create_buffers(flags, obs_shape, num_actions):
    T = flags.unroll_length
    specs = dict(
        frame=dict(size=(T + 1, *obs_shape), dtype=torch.uint8),
        reward=dict(size=(T + 1,), dtype=torch.float32),
        done=dict(size=(T + 1,), dtype=torch.bool),
        episode_return=dict(size=(T + 1,), dtype=torch.float32),
        policy_logits=dict(size=(T + 1, num_actions), dtype=torch.float32),
        baseline=dict(size=(T + 1,), dtype=torch.float32),
        action=dict(size=(T + 1,), dtype=torch.int64),
    )
    buffers = {key: [] for key in specs}
    for _ in range(flags.num_buffers):
        for key in buffers:
            buffers[key].append(torch.empty(**specs[key]).share_memory_())
    return buffers


def act(flags, actor_index, free_queue, full_queue, shared_model, buffers):
    try:
        log.info("Actor %i started.", actor_index)
        device = torch.device(flags.actor_device)
        local_model = AtariNet(shared_model.num_actions).to(device)
        local_model.eval()
        env = make_env(flags.env, seed=actor_index * 7919 + int(time.time()))
        obs = np.asarray(env.reset())
        reward, done, ep_return = 0.0, False, 0.0
        while True:
            index = free_queue.get()
            if index is None:
                break
            local_model.load_state_dict(shared_model.state_dict())
            for t in range(flags.unroll_length + 1):
                frame = torch.from_numpy(obs).to(device)[None, None]
                with torch.no_grad():
                    out = local_model(frame)
                a = out["action"].item()
                buffers["frame"][index][t, ...] = torch.from_numpy(obs)
                buffers["reward"][index][t] = reward
                buffers["done"][index][t] = done
                buffers["episode_return"][index][t] = ep_return
                buffers["policy_logits"][index][t, ...] = out["policy_logits"][0, 0].cpu()
                buffers["baseline"][index][t] = out["baseline"][0, 0].cpu()
                buffers["action"][index][t] = a
                obs, reward, done, _ = env.step(a)
                obs = np.asarray(obs)
                ep_return += reward
                if done:
                    obs = np.asarray(env.reset())
                    ep_return = 0.0
            full_queue.put(index)
    except KeyboardInterrupt:
        pass
    except Exception as e:
        log.error("Exception in worker process %i", actor_index)
        traceback.print_exc()
        raise e


def get_batch(flags, free_queue, full_queue, buffers, lock=threading.Lock()):
    with lock:
        indices = [full_queue.get() for _ in range(flags.batch_size)]
    batch = {key: torch.stack([buffers[key][m] for m in indices], dim=1) for key in buffers}
    for m in indices:
        free_queue.put(m)
    return {k: t.to(device=flags.learner_device, non_blocking=True) for k, t in batch.items()}


def compute_losses(flags, learner_outputs, batch):
    bootstrap_value = learner_outputs["baseline"][-1]
    batch = {key: tensor[1:] for key, tensor in batch.items()}
    learner_outputs = {key: tensor[:-1] for key, tensor in learner_outputs.items()}
    rewards = torch.clamp(batch["reward"], -1, 1)
    discounts = (~batch["done"]).float() * flags.discounting
    vtrace_returns = vtrace.from_logits(
        behavior_policy_logits=batch["policy_logits"],
        target_policy_logits=learner_outputs["policy_logits"],
        actions=batch["action"],
        discounts=discounts,
        rewards=rewards,
        values=learner_outputs["baseline"],
        bootstrap_value=bootstrap_value,
    )
    cross_entropy = F.nll_loss(
        F.log_softmax(torch.flatten(learner_outputs["policy_logits"], 0, 1), dim=-1),
        target=torch.flatten(batch["action"], 0, 1),
        reduction="none",
    ).view_as(vtrace_returns.pg_advantages)
    pg_loss = torch.sum(cross_entropy * vtrace_returns.pg_advantages.detach())
    baseline_loss = flags.baseline_cost * 0.5 * torch.sum((vtrace_returns.vs - learner_outputs["baseline"]) ** 2)
    policy = F.softmax(learner_outputs["policy_logits"], dim=-1)
    entropy_loss = flags.entropy_cost * torch.sum(policy * F.log_softmax(learner_outputs["policy_logits"], dim=-1))
    return pg_loss, baseline_loss, entropy_loss


def learn(flags, shared_model, learner_model, batch, optimizer, scheduler, lock=threading.Lock()):
    with lock:
        learner_outputs = learner_model(batch["frame"])
        pg_loss, baseline_loss, entropy_loss = compute_losses(flags, learner_outputs, batch)
        total_loss = pg_loss + baseline_loss + entropy_loss
        episode_returns = batch["episode_return"][batch["done"]]
        optimizer.zero_grad()
        total_loss.backward()
        nn.utils.clip_grad_norm_(learner_model.parameters(), flags.grad_norm_clipping)
        optimizer.step()
        scheduler.step()
        shared_model.load_state_dict(learner_model.state_dict())
        return {
            "total_loss": total_loss.item(),
            "pg_loss": pg_loss.item(),
            "mean_episode_return": torch.mean(episode_returns).item() if episode_returns.numel() else float("nan"),
        }


def train(flags):
    if flags.num_buffers is None:
        flags.num_buffers = max(2 * flags.num_actors, flags.batch_size)
    savedir = os.path.expanduser(flags.savedir)
    os.makedirs(savedir, exist_ok=True)

    probe_env = make_env(flags.env, seed=0)
    obs_shape = probe_env.observation_space.shape
    num_actions = probe_env.action_space.n
    probe_env.close()

    learner_model = AtariNet(num_actions).to(flags.learner_device)
    shared_model = AtariNet(num_actions)
    shared_model.load_state_dict(learner_model.state_dict())
    shared_model.share_memory()
    buffers = create_buffers(flags, obs_shape, num_actions)

    free_queue = mp.SimpleQueue()
    full_queue = mp.SimpleQueue()
    actor_processes = []
    for i in range(flags.num_actors):
        actor = mp.Process(target=act, args=(flags, i, free_queue, full_queue, shared_model, buffers))
        actor.start()
        actor_processes.append(actor)

    optimizer = torch.optim.RMSprop(
        learner_model.parameters(), lr=flags.learning_rate, momentum=0, eps=flags.epsilon, alpha=flags.alpha
    )
    T, B = flags.unroll_length, flags.batch_size

    def lr_lambda(epoch):
        return 1 - min(epoch * T * B, flags.total_steps) / flags.total_steps

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)

    step, stats = 0, {}

    def batch_and_learn(i):
        nonlocal step, stats
        while step < flags.total_steps:
            batch = get_batch(flags, free_queue, full_queue, buffers)
            stats = learn(flags, shared_model, learner_model, batch, optimizer, scheduler)
            step += T * B

    for m in range(flags.num_buffers):
        free_queue.put(m)

    threads = []
    for i in range(flags.num_learner_threads):
        thread = threading.Thread(target=batch_and_learn, name="batch-and-learn-%d" % i, args=(i,))
        thread.start()
        threads.append(thread)

    checkpointpath = os.path.join(savedir, "model.tar")
    last_checkpoint_time = timeit.default_timer()
    try:
        while step < flags.total_steps:
            start_step = step
            start_time = timeit.default_timer()
            time.sleep(5)
            if timeit.default_timer() - last_checkpoint_time > 10 * 60:
                torch.save({"model_state_dict": learner_model.state_dict(), "flags": vars(flags)}, checkpointpath)
                last_checkpoint_time = timeit.default_timer()
            sps = (step - start_step) / (timeit.default_timer() - start_time)
            log.info("Steps %i @ %.1f SPS. Stats: %s", step, sps, stats)
    except KeyboardInterrupt:
        return
    else:
        for thread in threads:
            thread.join()
        log.info("Learning finished after %d steps.", step)
    finally:
        for _ in range(flags.num_actors):
            free_queue.put(None)
        for actor in actor_processes:
            actor.join(timeout=1)

    torch.save({"model_state_dict": learner_model.state_dict(), "flags": vars(flags)}, checkpointpath)


if __name__ == "__main__":
    train(parser.parse_args())
