# The driver (jobs/driver.py) is this shell's process, so the --signal warning (B:USR1) reaches it.
# It writes the run directory from the resolved config below on the first start and reuses it on
# every requeue.
exec ${python} -u ${driver} ${run_dir} --config - <<'MOLT_CONFIG'
${config}
MOLT_CONFIG
