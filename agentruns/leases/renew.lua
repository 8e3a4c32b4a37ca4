-- Extend the lease only while ARGV[1] still holds it.
-- KEYS[1]: lease key; ARGV[1]: owner; ARGV[2]: ttl in milliseconds.
-- Returns 1 if extended, 0 if someone else (or nobody) holds it.
if redis.call("GET", KEYS[1]) == ARGV[1] then
  return redis.call("PEXPIRE", KEYS[1], ARGV[2])
end
return 0
