"""Slurm with ft (per-step fault tolerance, issue 37): the batch script's body when ft.enabled.

Inside one allocation the script runs
  * the torchft Lighthouse (`torchft_lighthouse`) as a step of its own on the batch host (--overlap: it shares
    that node with group 0), unless ft.lighthouse names one already running;
  * one `srun` step per replica group on its own nodes (the allocation's nodes in order, `group_nodes` each),
    each a torchrun world with its own rendezvous (the group's first node, a port of its own), started by a
    shell function that relaunches the step when it dies, up to job.max_requeues times, with a line in the
    job's log. The other groups' steps are never touched: they keep committing steps in a smaller quorum;
  * a node lost (issue 54): the job is submitted with --no-kill, so Slurm keeps the allocation when a node goes
    DOWN (it ends only that node's steps), and ft.spare_nodes more nodes than the groups need, idle at the end
    of the allocation. A group relaunched finds which of its nodes Slurm no longer calls up (DOWN, DRAIN, FAIL,
    NOT_RESPONDING) and takes a spare in their place (claimed with an atomic mkdir: two groups never take the
    same one); with none left it is not relaunched and the others finish without it. The batch host (group 0's
    first node, the Lighthouse's) is not covered: Slurm ends the job with it, and the job requeues as before;
  * it ends when every group has ended (their worst status is the script's) or when the Lighthouse dies (the
    groups are stopped: without a quorum no step commits; the requeued job resumes from the last checkpoint).
A group whose ranks wrote a `fatal` exit reason is not relaunched (a relaunch would repeat it); one whose ranks
wrote `dropped` (it left the quorum as a straggler, ft.straggler_steps) is relaunched after ft.straggler_backoff_s,
not counted against job.max_requeues.
"""

from __future__ import annotations

import math
from pathlib import Path

from llmcluster.launch.ft_local import REJOIN_ENV
from llmcluster.launch.ft_auth import SECRET_ENV, SECRET_FILE
from llmcluster.launch.spec import LIGHTHOUSE, LIGHTHOUSE_PORT, LaunchSpec, lighthouse_argv
from llmcluster.render import Program, ShellVar, shell_export, shell_join, shell_word
from llmcluster.storage.exit_reason import EXIT_DIR_ENV
from llmcluster.storage.layout import COMPLETE_MARKER

RELAUNCH_PAUSE_S = 2                   # between a dead step and its relaunch: no hot loop on a broken node
# exits 0 once something accepts connections at HOST PORT (the Lighthouse is up before the groups start)
LISTENING = Program("import socket, sys\n"
                    "socket.create_connection((sys.argv[1], int(sys.argv[2])), 1).close()\n")


def lighthouse_program(spec: LaunchSpec) -> str:
    """The Lighthouse executable: the console script beside the nodes' interpreter, or on PATH in a container."""
    if spec.job.image or "/" not in spec.python:
        return LIGHTHOUSE
    return str(Path(spec.python).parent / LIGHTHOUSE)


def body(spec: LaunchSpec, srun: list[str], port_python: str, free_port: str, container: list[str]) -> list[str]:
    """The lines that start the Lighthouse and the groups and wait for them; they leave `rc` (0: every group
    finished) and `preempted` set for the requeue logic after them. `srun` is the step's options without
    --nodes; `free_port` the rendered command that prints the first free port from its argument on;
    `container` the pyxis options (also for the Lighthouse step)."""
    j, ft, n, k = spec.job, spec.ft, spec.ft_groups, spec.group_nodes
    lines = [
        "",
        f"# ft: {n} replica group(s) of {k} node(s), each its own step and torchrun world, relaunched alone",
        'mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        "node_addr() {   # a node's NodeAddr (node names need not resolve)",
        '  local a; a=$(scontrol show node -o "$1" | tr " " "\\n" | sed -n "s/^NodeAddr=//p"); echo "${a:-$1}"',
        "}",
        "node_up() {     # Slurm still calls the node up (a lost node is DOWN or NOT_RESPONDING, a drained one DRAIN);",
        "                # no answer from the controller counts as up: a relaunch there fails and is tried again",
        '  local s; s=$(scontrol show node -o "$1" | tr " " "\\n" | sed -n "s/^State=//p")',
        '  [ -z "$s" ] || ! [[ "$s" =~ DOWN|DRAIN|FAIL|NOT_RESPONDING ]]',
        "}",
        f'spares=("${{nodes[@]:{n * k}}}")   # ft.spare_nodes: idle until a group loses a node',
        'spare_claims="$ranks_dir/spare-claims"; mkdir -p "$spare_claims"',
        "claim_spare() {  # the first spare node up that no group took yet (mkdir is atomic), or nothing",
        '  local s; for s in "${spares[@]}"; do node_up "$s" && mkdir "$spare_claims/$s" 2>/dev/null && '
        '{ echo "$s"; return 0; }; done; return 1',
        "}",
        shell_export("LLMCLUSTER_FT_GROUPS", n),
        "# the run's secret (launch/ft_auth.py), made 0600 by `llmcluster launch` when it submitted the job",
        shell_export(SECRET_ENV, f"{spec.logs}/ft/{SECRET_FILE}"),
        "lighthouse_pid=",
    ]
    if ft.lighthouse:
        lines += ["# ft.lighthouse: a Lighthouse already running",
                  shell_export("TORCHFT_LIGHTHOUSE", f"http://{ft.lighthouse}")]
    else:
        lh = ["srun", "--overlap", "--nodes=1", "--ntasks=1", ShellVar("--nodelist=$head_node"), *container,
              *lighthouse_argv(lighthouse_program(spec), ft, ShellVar("$head:$lighthouse_port"))]
        lines += [
            "# the Lighthouse (the quorum of the groups) on the batch host, a step of its own",
            f'lighthouse_port=$({free_port} '
            f'"$(( {LIGHTHOUSE_PORT} + SLURM_JOB_ID % 1000 ))")',
            shell_join(lh) + " &",
            "lighthouse_pid=$!",
            "for _ in $(seq 120); do",
            f'  {shell_word(port_python)} -c {shell_word(LISTENING)} "$head" "$lighthouse_port" 2>/dev/null && break',
            '  kill -0 "$lighthouse_pid" 2>/dev/null || break',
            "  sleep 0.5",
            "done",
            'export TORCHFT_LIGHTHOUSE="http://$head:$lighthouse_port"',
            'echo "[llmcluster] Lighthouse at $TORCHFT_LIGHTHOUSE (node $head_node)"',
        ]
    # --ntasks explicit: the step would inherit the allocation's SLURM_NTASKS (one task per node of the job)
    group_srun = [*srun, f"--nodes={k}", f"--ntasks={k}", ShellVar("--nodelist=$gnodes"), *container,
                  *spec.torchrun(spec.python, ShellVar("$ghead:$gport"), ShellVar("$SLURM_JOB_ID-group$g"),
                                 ShellVar(f"${EXIT_DIR_ENV}"))]
    lines += [
        "",
        "run_group() {   # group $1 on its nodes, rendezvous port $2; its step relaunched when it dies",
        "  local g=$1 gport=$2 gnodes ghead rc=0 relaunches=0 stop=0 srun_pid= fatal rejoin=0 node spare",
        f'  local mine=("${{nodes[@]:$(( g * {k} )):{k}}}") kept',
        "  trap 'stop=1; kill -USR2 \"$srun_pid\" 2>/dev/null' USR2",
        "  trap 'stop=1; kill -TERM \"$srun_pid\" 2>/dev/null' TERM",
        f'  export LLMCLUSTER_FT_GROUP="$g" {EXIT_DIR_ENV}="$ranks_dir/group-$g"',
        f'  mkdir -p "${EXIT_DIR_ENV}"',
        "  while :; do",
        '    gnodes=$(IFS=,; echo "${mine[*]}"); ghead=$(node_addr "${mine[0]}")',
        f'    rm -f "${EXIT_DIR_ENV}"/exit-rank*   # this launch\'s reasons only (a rank killed outright writes none)',
        '    echo "[llmcluster] group $g: nodes $gnodes, rendezvous $ghead:$gport (relaunch $relaunches)"',
        f"    export {REJOIN_ENV}=$rejoin   # a relaunched group joins as a reader (ft/writer.py)",
        "    " + shell_join(group_srun) + " &",
        "    srun_pid=$! rejoin=1",
        '    while :; do wait "$srun_pid"; rc=$?; [ "$rc" -gt 128 ] && kill -0 "$srun_pid" 2>/dev/null && continue;'
        " break; done",
        "    # under --no-kill srun exits 0 when a node of its step fails (\"Node failure on ...\"): not a finish",
        '    for node in "${mine[@]}"; do node_up "$node" || { [ "$rc" -eq 0 ] && rc=1; }; done',
        '    [ "$rc" -eq 0 ] && { echo "[llmcluster] group $g finished"; return 0; }',
        # a straggler the other groups left behind (ft.straggler_steps): back after the backoff, not a failure
        f'    if [ "$stop" = 0 ] && grep -qs "^dropped" "${EXIT_DIR_ENV}"/exit-rank*; then',
        f'      echo "[llmcluster] group $g left the quorum as a straggler: relaunching it in'
        f' {ft.straggler_backoff_s:g} s (ft.straggler_backoff_s)"',
        f"      sleep {ft.straggler_backoff_s:g}; continue",
        "    fi",
        # it gave up waiting for a quorum the other groups did not form (a hung or dead peer): theirs is the
        # failure, not its own (issue 62, invariant 3), so it is relaunched without using a relaunch
        f'    if [ "$stop" = 0 ] && grep -qs "^no_quorum" "${EXIT_DIR_ENV}"/exit-rank*; then',
        '      echo "[llmcluster] group $g gave up waiting for a quorum: relaunching it, not counted as its failure"',
        f"      sleep {RELAUNCH_PAUSE_S}; continue",
        "    fi",
        f'    fatal=$(cat "${EXIT_DIR_ENV}"/exit-rank* 2>/dev/null | grep -m 1 "^fatal")',
        f'    if [ "$stop" = 1 ] || [ -n "$fatal" ] || [ "$relaunches" -ge {j.max_requeues} ]; then',
        f'      echo "[llmcluster] group $g step exited with $rc: not relaunched'
        f' (${{fatal:-$([ "$stop" = 1 ] && echo stopped || echo "{j.max_requeues} relaunch(es) used")}})"',
        '      return "$rc"',
        "    fi",
        "    relaunches=$(( relaunches + 1 ))",
        f'    echo "[llmcluster] group $g step exited with $rc: relaunching it ($relaunches of {j.max_requeues});'
        ' the other groups keep running"',
        f"    sleep {RELAUNCH_PAUSE_S}",
        "    kept=()         # a node Slurm no longer calls up is replaced by a spare (--no-kill kept the job)",
        '    for node in "${mine[@]}"; do',
        '      if node_up "$node"; then kept+=("$node"); continue; fi',
        '      spare=$(claim_spare) || { echo "[llmcluster] group $g: node $node is down and no spare node is left'
        ' (ft.spare_nodes): not relaunched; the other groups go on without it"; return "$rc"; }',
        '      echo "[llmcluster] group $g: node $node is down: relaunching on spare node $spare"',
        '      kept+=("$spare")',
        "    done",
        '    mine=("${kept[@]}")',
        "  done",
        "}",
        "",
        "# each group's rendezvous on its own port (probed on the batch host, from the job's first choice on)",
        "group_pids=()",
        f'gport=$(( {j.rdzv_port} + SLURM_JOB_ID % 1000 - 1 ))',
        f"for g in $(seq 0 {n - 1}); do",
        f'  gport=$({free_port} "$(( gport + 1 ))")',
        '  run_group "$g" "$gport" &',
        "  group_pids+=($!)",
        "done",
        "preempted=0",
        "trap 'preempted=1; echo \"[llmcluster] SIGUSR2: checkpoint and stop\"; "
        "kill -USR2 \"${group_pids[@]}\" 2>/dev/null' USR2",
        "lighthouse_lost=0",
        "# invariant 4 (docs/fault-tolerance.md): once the run's final step is committed, the groups still running",
        "# after ft.end_grace_s (a frozen one: a healthy group sees the end itself) are not waited for: the job ends",
        "# and Slurm stops its steps; the run's end is durable, nothing of theirs is to save",
        "end_marker=" + shell_word(f"{spec.storage or spec.root}/checkpoints/{spec.run}/step_{spec.last_step}/"
                                   f"{COMPLETE_MARKER}"),
        "end_seen= ended=0",
        "while :; do      # until every group has ended, or the Lighthouse has, or the run has",
        "  live=0",
        '  for p in "${group_pids[@]}"; do kill -0 "$p" 2>/dev/null && live=1; done',
        '  [ "$live" = 0 ] && break',
        '  if [ -z "$end_seen" ] && [ -f "$end_marker" ]; then end_seen=$SECONDS;'
        f' echo "[llmcluster] the run\'s final step {spec.last_step} is committed"; fi',
        f'  if [ -n "$end_seen" ] && [ $(( SECONDS - end_seen )) -ge {math.ceil(ft.end_grace_s)} ]; then',
        f'    echo "[llmcluster] groups still running {math.ceil(ft.end_grace_s)} s after the run\'s end'
        ' (ft.end_grace_s): stopped, not waited for; the job ends and Slurm kills what is left"',
        '    ended=1; kill -TERM "${group_pids[@]}" 2>/dev/null; break',
        "  fi",
        '  if [ -n "$lighthouse_pid" ] && [ "$lighthouse_lost" = 0 ] && ! kill -0 "$lighthouse_pid" 2>/dev/null; then',
        '    echo "[llmcluster] the Lighthouse exited: stopping every group (no quorum without it)"',
        "    lighthouse_lost=1",
        '    kill -TERM "${group_pids[@]}" 2>/dev/null',
        "  fi",
        "  sleep 1",
        "done",
        "rc=0",
        'for p in "${group_pids[@]}"; do [ "$ended" = 1 ] && break; wait "$p"; r=$?; [ "$rc" -eq 0 ] && rc=$r; done',
        '[ "$lighthouse_lost" = 1 ] && [ "$rc" -eq 0 ] && rc=1',
        '[ -n "$lighthouse_pid" ] && { kill "$lighthouse_pid" 2>/dev/null; wait "$lighthouse_pid" 2>/dev/null; }',
        'echo "[llmcluster] groups exited with $rc"',
    ]
    return lines
